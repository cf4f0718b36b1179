/* The twin's stand-in programs (uname, pct, nvidia-smi, ...) as one small static binary.
 *
 * A real `uname -r` or `pct list` costs its host a few milliseconds; a Python stand-in started
 * fresh costs the twin 20-30 ms of CPU (interpreter, imports), and eight twins share this
 * machine's cores with the pyinfra run they serve. So each stand-in name is this client: it
 * hands its argv, cwd, environment and stdin/stdout/stderr (SCM_RIGHTS) to the twin's stand-in
 * server (standind.py, started by the supervisor at each boot, modules already imported), which
 * forks a worker that runs the same Python code on those descriptors; the client exits with
 * the worker's status.
 *
 * Where there is no server (a TWIN_ROOT test run, inside a CT root, the server not up yet) it
 * executes the Python stand-in itself: $TWIN_ROOT/usr/local/lib/twin/bin/<name>, same argv.
 * Behaviour is the same either way; only the CPU it costs differs. TWIN_STANDIN_SOCKET names
 * another server socket (tests).
 *
 * Wire format (one stream socket per call): client -> server: u32 length, then `length` bytes
 * of NUL-terminated strings: exe path, argv[0], cwd, "argc", argv[1..], "envc", env...; the
 * three descriptors ride on the first sendmsg. server -> client: i32 exit status (0-255, or
 * 128+signal).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SOCKET_PATH "/run/twin/standins.sock"
#define FALLBACK_DIR "/usr/local/lib/twin/bin/"

extern char **environ;

static void fallback(char **argv) {
    const char *name = strrchr(argv[0], '/');
    name = name ? name + 1 : argv[0];
    const char *root = getenv("TWIN_ROOT");
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s" FALLBACK_DIR "%s", root && strcmp(root, "/") ? root : "", name);
    execv(path, argv);
    fprintf(stderr, "twin stand-in %s: no server and no %s: %s\n", name, path, strerror(errno));
    _exit(127);
}

struct buf { char *data; size_t len, cap; };

static void put(struct buf *b, const char *s) {
    size_t n = strlen(s) + 1;
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2;
        b->data = realloc(b->data, b->cap);
        if (!b->data) _exit(255);
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
}

int main(int argc, char **argv) {
    /* TWIN_STANDIN_SOCKET: a test's server. TWIN_ROOT alone: a test against a tmp root, whose
     * stand-ins are not this twin's server's. */
    const char *socket_path = getenv("TWIN_STANDIN_SOCKET");
    if (!socket_path && getenv("TWIN_ROOT")) fallback(argv);
    if (!socket_path) socket_path = SOCKET_PATH;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, socket_path, sizeof addr.sun_path - 1);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) fallback(argv);

    char exe[PATH_MAX], cwd[PATH_MAX], num[32];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = 0;
    if (!getcwd(cwd, sizeof cwd)) strcpy(cwd, "/");
    struct buf b = {0};
    b.len = 4;  /* room for the length */
    b.cap = 4096;
    b.data = malloc(b.cap);
    if (!b.data) _exit(255);
    put(&b, exe);
    put(&b, argv[0]);
    put(&b, cwd);
    snprintf(num, sizeof num, "%d", argc - 1);
    put(&b, num);
    for (int i = 1; i < argc; i++) put(&b, argv[i]);
    int envc = 0;
    for (char **e = environ; *e; e++) envc++;
    snprintf(num, sizeof num, "%d", envc);
    put(&b, num);
    for (char **e = environ; *e; e++) put(&b, *e);
    uint32_t len = (uint32_t)(b.len - 4);
    memcpy(b.data, &len, 4);

    int fds[3] = {0, 1, 2};
    char control[CMSG_SPACE(sizeof fds)];
    memset(control, 0, sizeof control);
    struct iovec iov = {.iov_base = b.data, .iov_len = b.len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent <= 0) fallback(argv);  /* nothing was run yet */
    size_t off = (size_t)sent;
    while (off < b.len) {
        ssize_t k = send(fd, b.data + off, b.len - off, MSG_NOSIGNAL);
        if (k <= 0) {
            fprintf(stderr, "twin stand-in: server went away\n");
            _exit(255);
        }
        off += (size_t)k;
    }
    int32_t status;
    size_t got = 0;
    while (got < sizeof status) {
        ssize_t k = read(fd, (char *)&status + got, sizeof status - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            fprintf(stderr, "twin stand-in: server went away\n");
            _exit(255);
        }
        got += (size_t)k;
    }
    return status;
}
