/* Connection-rate load for bench/workers_bench.py: a SOCKS5 client and an echo server in C.
 *
 * Why C: on a 2-core host the load generator and the bench server share the cores with the
 * proxy under test. In Python they cost more CPU per connection than the proxy itself, so one
 * proxy's gain from a second worker could not show. Here they cost a small part of it.
 *
 *   loadgen client SOCKS_IP SOCKS_PORT BIND_IP TARGET_IP TARGET_PORT CONCURRENCY SECONDS
 *       keeps CONCURRENCY connections in flight for SECONDS: connect to the proxy's SOCKS5
 *       port from BIND_IP (the proxy tells its workload by source address), send the greeting
 *       and the CONNECT request in one write, read the two replies (12 bytes), send one byte,
 *       read its echo, close. Prints one JSON line: connections, failed, seconds, conn_s, and
 *       slow (connections that took over SLOW_CONNECTION_S: a dropped SYN waits 1 s for its
 *       retransmission, which no proxy work explains) and max_ms (the longest one).
 *   loadgen server BIND_IP
 *       echoes every connection on an ephemeral port until killed; prints "listening PORT".
 *
 * Bounds: SECONDS at most 60, CONCURRENCY at most 1024, each connection at most 10 s.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24
#endif

#define MAX_CONCURRENCY 1024
#define MAX_SECONDS 60.0
#define CONNECTION_TIMEOUT_S 10.0
#define SLOW_CONNECTION_S 0.5
#define MAX_EVENTS 256

enum phase { CONNECTING, HANDSHAKE, ECHO };

struct slot {
    int fd;
    enum phase phase;
    int got;
    double started;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int parse_addr(const char *ip, int port, struct sockaddr_in *out) {
    memset(out, 0, sizeof(*out));
    out->sin_family = AF_INET;
    out->sin_port = htons((unsigned short)port);
    return inet_pton(AF_INET, ip, &out->sin_addr) == 1 ? 0 : -1;
}

static struct sockaddr_in socks_addr, bind_addr;
static unsigned char request[13];
static int epfd;

static int open_slot(struct slot *s) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&bind_addr, sizeof(bind_addr)) < 0 ||
        (connect(fd, (struct sockaddr *)&socks_addr, sizeof(socks_addr)) < 0 && errno != EINPROGRESS)) {
        close(fd);
        return -1;
    }
    s->fd = fd;
    s->phase = CONNECTING;
    s->got = 0;
    s->started = now_s();
    struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = s};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        close(fd);
        return -1;
    }
    return 0;
}

static void close_slot(struct slot *s) {
    close(s->fd); /* also leaves the epoll set */
    s->fd = -1;
}

/* Moves a slot on after an event; returns 1 when its connection completed, -1 on failure. */
static int step(struct slot *s) {
    unsigned char buf[64];
    if (s->phase == CONNECTING) {
        int err = 0;
        socklen_t len = sizeof(err);
        if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err != 0) return -1;
        if (send(s->fd, request, sizeof(request), MSG_NOSIGNAL) != (ssize_t)sizeof(request)) return -1;
        s->phase = HANDSHAKE;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
        return epoll_ctl(epfd, EPOLL_CTL_MOD, s->fd, &ev) < 0 ? -1 : 0;
    }
    ssize_t n = recv(s->fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (n <= 0) return -1;
    if (s->phase == HANDSHAKE) {
        s->got += (int)n;
        if (s->got < 12) return 0;
        if (s->got > 12) return -1; /* nothing may follow the replies before our byte */
        if (send(s->fd, "x", 1, MSG_NOSIGNAL) != 1) return -1;
        s->phase = ECHO;
        return 0;
    }
    return (n == 1 && buf[0] == 'x') ? 1 : -1;
}

static int run_client(char **argv) {
    struct sockaddr_in target;
    if (parse_addr(argv[0], atoi(argv[1]), &socks_addr) || parse_addr(argv[2], 0, &bind_addr) ||
        parse_addr(argv[3], atoi(argv[4]), &target)) {
        fprintf(stderr, "loadgen: bad address\n");
        return 2;
    }
    int concurrency = atoi(argv[5]);
    double seconds = atof(argv[6]);
    if (concurrency < 1 || concurrency > MAX_CONCURRENCY || !(seconds > 0) || seconds > MAX_SECONDS) {
        fprintf(stderr, "loadgen: concurrency 1-%d and seconds (0, %.0f] please\n", MAX_CONCURRENCY, MAX_SECONDS);
        return 2;
    }
    /* SOCKS5 (RFC 1928): greeting (no authentication), then CONNECT to an IPv4 address. */
    memcpy(request, "\x05\x01\x00\x05\x01\x00\x01", 7);
    memcpy(request + 7, &target.sin_addr, 4);
    memcpy(request + 11, &target.sin_port, 2);
    epfd = epoll_create1(0);
    static struct slot slots[MAX_CONCURRENCY];
    long done = 0, failed = 0, slow = 0;
    double max_s = 0;
    double begin = now_s(), deadline = begin + seconds;
    for (int i = 0; i < concurrency; i++)
        if (open_slot(&slots[i]) < 0) slots[i].fd = -1, failed++;
    int open = 0;
    for (int i = 0; i < concurrency; i++) open += slots[i].fd >= 0;
    struct epoll_event events[MAX_EVENTS];
    while (open > 0) {
        double t = now_s();
        int n = epoll_wait(epfd, events, MAX_EVENTS, 100);
        if (n < 0 && errno != EINTR) break;
        for (int i = 0; i < n; i++) {
            struct slot *s = events[i].data.ptr;
            if (s->fd < 0) continue;
            int r = step(s);
            if (r == 0) continue;
            if (r > 0) {
                double took = now_s() - s->started;
                done++;
                if (took > SLOW_CONNECTION_S) slow++;
                if (took > max_s) max_s = took;
            } else {
                failed++;
            }
            close_slot(s);
            open--;
            if (now_s() < deadline) {
                if (open_slot(s) == 0) open++; else failed++;
            }
        }
        if (t - begin > seconds + CONNECTION_TIMEOUT_S) break; /* the bound on the whole run */
        for (int i = 0; i < concurrency && n == 0; i++) {
            if (slots[i].fd >= 0 && t - slots[i].started > CONNECTION_TIMEOUT_S) {
                close_slot(&slots[i]);
                open--;
                failed++;
            }
        }
    }
    double elapsed = now_s() - begin;
    printf("{\"connections\": %ld, \"failed\": %ld, \"seconds\": %.3f, \"conn_s\": %.1f, \"slow\": %ld, "
           "\"max_ms\": %.1f}\n",
           done, failed, elapsed, done / elapsed, slow, max_s * 1000);
    return 0;
}

static int run_server(char **argv) {
    struct sockaddr_in addr;
    if (parse_addr(argv[0], 0, &addr)) {
        fprintf(stderr, "loadgen: bad address\n");
        return 2;
    }
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(lfd, (struct sockaddr *)&addr, sizeof(addr)) < 0 || listen(lfd, 4096) < 0) {
        perror("loadgen: listen");
        return 1;
    }
    socklen_t len = sizeof(addr);
    getsockname(lfd, (struct sockaddr *)&addr, &len);
    printf("listening %d\n", ntohs(addr.sin_port));
    fflush(stdout);
    epfd = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd};
    epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &ev);
    struct epoll_event events[MAX_EVENTS];
    unsigned char buf[4096];
    for (;;) { /* until killed: the bench kills it after each configuration */
        int n = epoll_wait(epfd, events, MAX_EVENTS, -1);
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == lfd) {
                int c;
                while ((c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
                    struct epoll_event cev = {.events = EPOLLIN, .data.fd = c};
                    if (epoll_ctl(epfd, EPOLL_CTL_ADD, c, &cev) < 0) close(c);
                }
                continue;
            }
            ssize_t got = recv(fd, buf, sizeof(buf), 0);
            if (got < 0 && errno == EAGAIN) continue;
            if (got <= 0 || send(fd, buf, (size_t)got, MSG_NOSIGNAL) != got) close(fd);
        }
    }
}

int main(int argc, char **argv) {
    if (argc == 9 && strcmp(argv[1], "client") == 0) return run_client(argv + 2);
    if (argc == 3 && strcmp(argv[1], "server") == 0) return run_server(argv + 2);
    fprintf(stderr, "usage: loadgen client SOCKS_IP SOCKS_PORT BIND_IP TARGET_IP TARGET_PORT CONCURRENCY SECONDS\n"
                    "       loadgen server BIND_IP\n");
    return 2;
}
