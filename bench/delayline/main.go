// delayline: a TCP proxy that delays every byte by a fixed one-way latency in each direction,
// for the staging benchmark on kernels without the netem qdisc (the dev VM's kernel has tbf
// and htb but no netem). Each direction is a delay line: a chunk read at time t is written at
// t + delay, chunks in order, so a request/response exchange sees 2 x delay of round trip
// while a long transfer keeps its bandwidth (bounded by the link, e.g. a tbf cap on the veth
// the benchmark puts in front of this proxy). TCP's own windows are not delayed, so slow start
// is not emulated: this is an optimistic model of a long fat pipe, the same for the reference
// single stream and for kuberl stage.
//
//	delayline -listen 10.231.0.2:9000 -upstream 127.0.0.1:9001 -delay 10ms
package main

import (
	"flag"
	"log"
	"net"
	"time"
)

type chunk struct {
	due  time.Time
	data []byte
}

func pipe(dst, src net.Conn, delay time.Duration) {
	line := make(chan chunk, 64) // at most 64 reads (16 MiB) in flight per direction
	go func() {
		defer close(line)
		for {
			buf := make([]byte, 256<<10)
			n, err := src.Read(buf)
			if n > 0 {
				line <- chunk{time.Now().Add(delay), buf[:n]}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range line {
		time.Sleep(time.Until(c.due))
		if _, err := dst.Write(c.data); err != nil {
			break
		}
	}
	for range line { // drain so the reader can finish
	}
	if tcp, ok := dst.(*net.TCPConn); ok {
		tcp.CloseWrite()
	} else {
		dst.Close()
	}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to accept on")
	upstream := flag.String("upstream", "", "address to forward to")
	delay := flag.Duration("delay", 10*time.Millisecond, "one-way delay per direction")
	flag.Parse()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	for {
		client, err := ln.Accept()
		if err != nil {
			log.Fatal(err)
		}
		go func(client net.Conn) {
			server, err := net.Dial("tcp", *upstream)
			if err != nil {
				client.Close()
				return
			}
			done := make(chan struct{}, 2)
			go func() { pipe(server, client, *delay); done <- struct{}{} }()
			go func() { pipe(client, server, *delay); done <- struct{}{} }()
			<-done
			<-done
			client.Close()
			server.Close()
		}(client)
	}
}

