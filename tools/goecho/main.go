// Command goecho is a goroutine-per-connection TCP echo server: the kind of
// backend a `ConnectionFleet` with `backend.model: goroutine` runs, built
// into the c10m/goecho image by `make images` (tools/images.sh) so the
// calibration tests measure a real Go server on the real node
// (tests/tests/real_node.rs, issue 24).
//
// It is written the way most Go servers are: net.Listen, one goroutine per
// accepted connection, a blocking Read into a buffer of its own and a
// blocking Write of what was read; the runtime's netpoller does the rest.
// That is what the capacity model's goroutine figure prices: a goroutine
// stack (2 KiB to start, grown to fit the read loop), the buffer, the
// net.Conn and its poll descriptor, per idle connection.
//
// The contract with the operator is the bundled server's, as far as a
// backend needs it (wire/src/lib.rs):
//
//	C10M_BIND             the address both listeners bind (default: all)
//	C10M_PORT             the connection listener's port (default 7100)
//	C10M_METRICS_PORT     GET /healthz (200, the readiness and liveness
//	                      probes) and GET /metrics (c10m_connections, in the
//	                      Prometheus text format) (default 9100)
//	C10M_MAX_CONNECTIONS  connections held at once; one more is accepted and
//	                      closed at once (default: no bound)
//	GOMAXPROCS, GOMEMLIMIT  read by the Go runtime itself; the operator sets
//	                      them from the plan
//
// SIGTERM closes the listener, then every connection, and exits 0.
package main

import (
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
)

// bufferBytes is each connection's read buffer: 4 KiB, the size of
// bufio's default reader and of the echo servers in Go's own examples.
const bufferBytes = 4096

func envInt(name string, fallback int) int {
	v := os.Getenv(name)
	if v == "" {
		return fallback
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		log.Fatalf("goecho: %s=%q is not a non-negative integer", name, v)
	}
	return n
}

type server struct {
	max   int64 // 0: no bound
	open  atomic.Int64
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func (s *server) track(c net.Conn, add bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if add {
		s.conns[c] = struct{}{}
	} else {
		delete(s.conns, c)
	}
}

// serve echoes what c sends until it closes or errs.
func (s *server) serve(c net.Conn) {
	defer func() {
		s.track(c, false)
		s.open.Add(-1)
		c.Close()
	}()
	buf := make([]byte, bufferBytes)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (s *server) accept(ln net.Listener) error {
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			// EMFILE and the like: the connection waits in the backlog.
			log.Printf("goecho: accept: %v", err)
			continue
		}
		if s.max > 0 && s.open.Load() >= s.max {
			c.Close()
			continue
		}
		s.open.Add(1)
		s.track(c, true)
		go s.serve(c)
	}
}

func main() {
	bind := os.Getenv("C10M_BIND")
	port := envInt("C10M_PORT", 7100)
	metricsPort := envInt("C10M_METRICS_PORT", 9100)
	s := &server{max: int64(envInt("C10M_MAX_CONNECTIONS", 0)), conns: map[net.Conn]struct{}{}}

	ln, err := net.Listen("tcp", net.JoinHostPort(bind, strconv.Itoa(port)))
	if err != nil {
		log.Fatalf("goecho: listen on %s:%d: %v", bind, port, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		fmt.Fprintf(w, "# HELP c10m_connections Connections the server holds.\n"+
			"# TYPE c10m_connections gauge\nc10m_connections %d\n", s.open.Load())
	})
	admin := &http.Server{Addr: net.JoinHostPort(bind, strconv.Itoa(metricsPort)), Handler: mux}
	go func() {
		if err := admin.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Fatalf("goecho: metrics on %s:%d: %v", bind, metricsPort, err)
		}
	}()

	done := make(chan error, 1)
	go func() { done <- s.accept(ln) }()
	log.Printf("goecho: echo on %s:%d, /healthz and /metrics on port %d, max %d connections",
		bind, port, metricsPort, s.max)

	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)
	select {
	case sig := <-term:
		log.Printf("goecho: %v: closing", sig)
	case err := <-done:
		log.Fatalf("goecho: accept loop ended: %v", err)
	}
	ln.Close()
	admin.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
}
