/* xrun: runs a command and writes its resource usage to a file when it ends.
 *
 *   xrun OUTFILE CMD [ARGS...]
 *
 * OUTFILE gets one line: "exit=N user=S sys=S maxrss_kb=K" from wait4() on CMD, which covers
 * CMD and every descendant it reaped (GridFTP's per-session processes). xrun exits as CMD did.
 * SIGTERM, SIGINT and SIGHUP are passed on to CMD, so a server can be stopped through xrun.
 *
 * Why not measure from the driver: a child forked from Python starts with a copy of Python's
 * address space, and Linux folds that into the child's peak RSS at exec (ru_maxrss); forked
 * from this small static program, the baseline is a few hundred KiB instead of ~14 MiB.
 *
 * Compiled by perf/bench.py at startup (cc -O2 -static). C, no dependencies.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile pid_t child = 0;

static void forward(int sig) {
  if (child > 0) kill(child, sig);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: xrun OUTFILE CMD [ARGS...]\n");
    return 2;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = forward;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);

  pid_t pid = fork();
  if (pid < 0) {
    perror("xrun: fork");
    return 127;
  }
  if (pid == 0) {
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* dies with xrun, which dies with the driver */
    execvp(argv[2], argv + 2);
    fprintf(stderr, "xrun: %s: %s\n", argv[2], strerror(errno));
    _exit(127);
  }
  child = pid;
  int status = 0;
  struct rusage ru;
  memset(&ru, 0, sizeof ru);
  while (wait4(pid, &status, 0, &ru) < 0) {
    if (errno != EINTR) {
      perror("xrun: wait4");
      return 127;
    }
  }
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 255;
  FILE* f = fopen(argv[1], "w");
  if (f) {
    fprintf(f, "exit=%d user=%ld.%06ld sys=%ld.%06ld maxrss_kb=%ld\n", code, (long)ru.ru_utime.tv_sec,
            (long)ru.ru_utime.tv_usec, (long)ru.ru_stime.tv_sec, (long)ru.ru_stime.tv_usec, ru.ru_maxrss);
    fclose(f);
  }
  return code;
}
