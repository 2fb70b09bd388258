/* Sandbox ("pause") process for the real node's pods: holds the pod's
 * namespaces, sleeps until SIGTERM/SIGINT and reaps any children (it is PID 1
 * of the pod's PID namespace when the pod shares one). Built statically by
 * tests/cluster/build.sh (gcc -static) and packed FROM scratch by mkimage.sh. */
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) {
  (void)sig;
  _exit(0);
}

static void on_chld(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_term;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  sa.sa_handler = on_chld;
  sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  sigaction(SIGCHLD, &sa, NULL);
  for (;;) pause();
}
