// How gshmem's PEs find each other: an all-gather of equal-sized byte strings and a barrier,
// over MPI or a TCP rendezvous. Failures throw gshmem::Error.
#pragma once

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>

namespace gshmem {

/** A failure with its reason, turned into -1 and gshmem_error() at the C boundary. */
struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

class Bootstrap {
  public:
    virtual ~Bootstrap() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    /** Every rank's `bytes` of `mine`, in rank order, into `all` (size() * bytes). */
    virtual void allgather(const void *mine, void *all, std::size_t bytes) = 0;
    virtual void barrier() = 0;
    /** "mpi" or "tcp". */
    virtual const char *name() const = 0;
};

/** Rank 0 listens at `addr` ("ip:port") and the others connect to it; every wait is bounded by
 *  `timeout_ms`. */
std::unique_ptr<Bootstrap> tcp_bootstrap(const std::string &addr, int rank, int nranks, int timeout_ms);

/** MPI_COMM_WORLD; nullptr when gshmem was built without MPI. */
std::unique_ptr<Bootstrap> mpi_bootstrap();

/** Whether this process looks started by an MPI launcher. */
bool launched_by_mpi();

} // namespace gshmem
