// The TCP bootstrap: rank 0 listens at GSHMEM_TCP_ADDR and every other rank connects to it (a
// star), so N processes started by hand, a job script or a container orchestrator find each
// other without MPI. Every wait is bounded; a peer that dies or sends something else ends the
// bootstrap with an error naming it.
#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "bootstrap.hpp"

namespace gshmem {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t MAGIC = 0x47534842; // "GSHB"

std::string os_error(const std::string &what) { return what + ": " + std::strerror(errno); }

sockaddr_in parse(const std::string &addr) {
    auto colon = addr.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    char *end = nullptr;
    unsigned long port = colon == std::string::npos ? 0 : std::strtoul(addr.c_str() + colon + 1, &end, 10);
    if (colon == std::string::npos || end == nullptr || *end != '\0' || port > 65535 ||
        inet_pton(AF_INET, addr.substr(0, colon).c_str(), &sa.sin_addr) != 1)
        throw Error("GSHMEM_TCP_ADDR \"" + addr + "\" is not an IPv4 \"ip:port\"");
    sa.sin_port = htons((uint16_t)port);
    return sa;
}

/** A socket that closes itself. */
struct Fd {
    int fd = -1;
    Fd() = default;
    explicit Fd(int f) : fd(f) {}
    Fd(Fd &&o) noexcept : fd(o.fd) { o.fd = -1; }
    Fd &operator=(Fd &&o) noexcept {
        std::swap(fd, o.fd);
        return *this;
    }
    ~Fd() {
        if (fd >= 0) close(fd);
    }
};

class Tcp final : public Bootstrap {
  public:
    Tcp(const std::string &addr, int rank, int nranks, int timeout_ms)
        : rank_(rank), size_(nranks), timeout_(std::chrono::milliseconds(timeout_ms)) {
        if (nranks < 1 || rank < 0 || rank >= nranks)
            throw Error("TCP bootstrap: rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                        " (set GSHMEM_RANK to 0..GSHMEM_NRANKS-1)");
        if (nranks == 1) return;
        sockaddr_in sa = parse(addr);
        auto deadline = Clock::now() + timeout_;
        if (rank == 0) {
            accept_all(sa, addr, deadline);
        } else {
            peers_.push_back(connect_root(sa, addr, deadline));
            uint32_t hello[3] = {MAGIC, (uint32_t)rank, (uint32_t)nranks};
            send_all(peers_[0], hello, sizeof hello, "rank 0");
        }
    }
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    const char *name() const override { return "tcp"; }

    void allgather(const void *mine, void *all, std::size_t bytes) override {
        auto *out = static_cast<unsigned char *>(all);
        std::memcpy(out + (std::size_t)rank_ * bytes, mine, bytes);
        if (size_ == 1) return;
        uint64_t len = bytes;
        if (rank_ != 0) {
            send_all(peers_[0], &len, sizeof len, "rank 0");
            send_all(peers_[0], mine, bytes, "rank 0");
            uint64_t total = 0;
            recv_all(peers_[0], &total, sizeof total, "rank 0");
            if (total != bytes * (uint64_t)size_)
                throw Error("TCP bootstrap: rank 0 sent " + std::to_string(total) + " bytes, expected " +
                            std::to_string(bytes * (uint64_t)size_));
            recv_all(peers_[0], out, bytes * size_, "rank 0");
            return;
        }
        for (int r = 1; r < size_; r++) {
            std::string who = "rank " + std::to_string(r);
            uint64_t theirs = 0;
            recv_all(peers_[r - 1], &theirs, sizeof theirs, who);
            if (theirs != bytes)
                throw Error("TCP bootstrap: " + who + " contributes " + std::to_string(theirs) + " bytes, rank 0 " +
                            std::to_string(bytes) + " (the PEs disagree on the job)");
            recv_all(peers_[r - 1], out + (std::size_t)r * bytes, bytes, who);
        }
        uint64_t total = bytes * (uint64_t)size_;
        for (int r = 1; r < size_; r++) {
            std::string who = "rank " + std::to_string(r);
            send_all(peers_[r - 1], &total, sizeof total, who);
            send_all(peers_[r - 1], out, total, who);
        }
    }

    void barrier() override {
        std::vector<unsigned char> all(size_);
        unsigned char mine = 1;
        allgather(&mine, all.data(), 1);
    }

  private:
    int rank_, size_;
    std::chrono::milliseconds timeout_;
    /** Rank 0: ranks 1.. in order; others: rank 0. */
    std::vector<Fd> peers_;

    int ms_left(Clock::time_point deadline) const {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        return left > 0 ? (int)left : 0;
    }
    void wait(const Fd &s, short events, Clock::time_point deadline, const std::string &who) {
        for (;;) {
            pollfd p{s.fd, events, 0};
            int n = poll(&p, 1, ms_left(deadline));
            if (n > 0) return;
            if (n == 0) throw Error("TCP bootstrap: " + who + " sent nothing for " +
                                    std::to_string(timeout_.count()) + " ms (GSHMEM_TIMEOUT_MS)");
            if (errno != EINTR) throw Error(os_error("TCP bootstrap: poll"));
        }
    }
    void send_all(const Fd &s, const void *buf, std::size_t len, const std::string &who) {
        auto deadline = Clock::now() + timeout_;
        auto *p = static_cast<const unsigned char *>(buf);
        while (len > 0) {
            wait(s, POLLOUT, deadline, who);
            ssize_t n = send(s.fd, p, len, MSG_NOSIGNAL);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) throw Error(os_error("TCP bootstrap: sending to " + who));
            p += n;
            len -= (std::size_t)n;
        }
    }
    void recv_all(const Fd &s, void *buf, std::size_t len, const std::string &who) {
        auto deadline = Clock::now() + timeout_;
        auto *p = static_cast<unsigned char *>(buf);
        while (len > 0) {
            wait(s, POLLIN, deadline, who);
            ssize_t n = recv(s.fd, p, len, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n == 0) throw Error("TCP bootstrap: " + who + " closed the connection (did it exit?)");
            if (n < 0) throw Error(os_error("TCP bootstrap: receiving from " + who));
            p += n;
            len -= (std::size_t)n;
        }
    }

    void accept_all(const sockaddr_in &sa, const std::string &addr, Clock::time_point deadline) {
        Fd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (listener.fd < 0) throw Error(os_error("TCP bootstrap: socket"));
        int one = 1;
        setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(listener.fd, (const sockaddr *)&sa, sizeof sa) != 0)
            throw Error(os_error("TCP bootstrap: rank 0 cannot listen at " + addr));
        if (listen(listener.fd, size_) != 0) throw Error(os_error("TCP bootstrap: listen"));
        std::vector<Fd> by_rank(size_);
        for (int joined = 1; joined < size_;) {
            wait(listener, POLLIN, deadline,
                 "nobody (" + std::to_string(size_ - joined) + " of " + std::to_string(size_ - 1) +
                     " ranks still missing at " + addr + ")");
            Fd s(accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
            if (s.fd < 0) {
                if (errno == EINTR || errno == ECONNABORTED) continue;
                throw Error(os_error("TCP bootstrap: accept"));
            }
            setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            uint32_t hello[3] = {0, 0, 0};
            recv_all(s, hello, sizeof hello, "a connecting rank");
            if (hello[0] != MAGIC) throw Error("TCP bootstrap: something that is not a gshmem rank connected to " + addr);
            if (hello[2] != (uint32_t)size_ || hello[1] == 0 || hello[1] >= (uint32_t)size_ || by_rank[hello[1]].fd >= 0)
                throw Error("TCP bootstrap: a rank says it is " + std::to_string(hello[1]) + " of " +
                            std::to_string(hello[2]) + "; rank 0 expects ranks 1.." + std::to_string(size_ - 1) +
                            " of " + std::to_string(size_) + ", each once");
            by_rank[hello[1]] = std::move(s);
            joined++;
        }
        for (int r = 1; r < size_; r++) peers_.push_back(std::move(by_rank[r]));
    }

    Fd connect_root(const sockaddr_in &sa, const std::string &addr, Clock::time_point deadline) {
        for (;;) {
            Fd s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
            if (s.fd < 0) throw Error(os_error("TCP bootstrap: socket"));
            if (connect(s.fd, (const sockaddr *)&sa, sizeof sa) == 0) {
                int one = 1;
                setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                return s;
            }
            // Rank 0 may not be listening yet: retry until the deadline.
            if (errno != ECONNREFUSED && errno != EINTR && errno != ETIMEDOUT)
                throw Error(os_error("TCP bootstrap: connecting to rank 0 at " + addr));
            if (Clock::now() >= deadline)
                throw Error("TCP bootstrap: rank 0 is not listening at " + addr + " after " +
                            std::to_string(timeout_.count()) + " ms (GSHMEM_TIMEOUT_MS)");
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
    }
};

} // namespace

std::unique_ptr<Bootstrap> tcp_bootstrap(const std::string &addr, int rank, int nranks, int timeout_ms) {
    return std::make_unique<Tcp>(addr, rank, nranks, timeout_ms);
}

} // namespace gshmem
