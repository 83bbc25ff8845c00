# The four images of images/Dockerfile in one command, from the repository root:
#   docker buildx bake                       # all four (add --push to push them)
#   docker buildx bake operator worker-cpu   # some
# Other names: REPOSITORY=registry.example.com/kuberl VERSION=dev docker buildx bake
variable "REPOSITORY" {
  default = "ghcr.io/kuberl"
}

variable "VERSION" {
  default = "0.1.0"
}

group "default" {
  targets = ["operator", "stager", "worker", "worker-cpu"]
}

target "_common" {
  context    = "."
  dockerfile = "images/Dockerfile"
}

target "operator" {
  inherits = ["_common"]
  target   = "operator"
  tags     = ["${REPOSITORY}/operator:${VERSION}"]
}

target "stager" {
  inherits = ["_common"]
  target   = "stager"
  tags     = ["${REPOSITORY}/stager:${VERSION}"]
}

target "worker" {
  inherits = ["_common"]
  target   = "worker"
  tags     = ["${REPOSITORY}/worker:${VERSION}"]
}

target "worker-cpu" {
  inherits = ["_common"]
  target   = "worker-cpu"
  tags     = ["${REPOSITORY}/worker-cpu:${VERSION}"]
}
