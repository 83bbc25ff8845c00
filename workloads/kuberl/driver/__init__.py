"""kuberl.driver: the driver process (``python -m kuberl.driver``, ``kuberl train``), on the head.

- ``loop``: ``Driver``, the RL loop of any algorithm; ``schedule``: the step's order (pure);
- ``data``: the data set's prompts in (seed, step) order; ``rewards``: reward functions, in Ray tasks;
- ``sampling``: dynamic sampling's refill rounds; ``updates``: the step's mini-batch updates;
- ``validation``, ``report`` (status), ``tracking``, ``progress`` (a local run's console);
- ``checkpoints``: when to save and the commit after every rank's upload;
- ``preflight``: the job's own code, loaded before Ray starts; ``tiny``: the embedded job's model.

It holds the trainer ranks (``kuberl.train``) and engines (``kuberl.rollout``); neither imports it.
"""
