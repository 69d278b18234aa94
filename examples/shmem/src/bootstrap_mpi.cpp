// The MPI bootstrap (built with GSHMEM_WITH_MPI, i.e. `make MPI=1`): MPI_COMM_WORLD's ranks are
// the PEs. MPI is initialised here unless the program did it, and finalised at exit then.
#include <cstdint>
#include <cstdlib>

#include "bootstrap.hpp"

#ifdef GSHMEM_WITH_MPI
// MPI's C API only (the deprecated C++ bindings do not compile warning-free).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace gshmem {

bool launched_by_mpi() {
    // Open MPI's mpirun, and PMI/PMIx launchers (srun, MPICH's hydra).
    for (const char *v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
        if (std::getenv(v) != nullptr) return true;
    return false;
}

#ifdef GSHMEM_WITH_MPI

namespace {

void check(int rc, const char *what) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw Error(std::string(what) + ": " + std::string(text, len));
}

class Mpi final : public Bootstrap {
  public:
    Mpi() {
        int ready = 0;
        check(MPI_Initialized(&ready), "MPI_Initialized");
        if (!ready) {
            check(MPI_Init(nullptr, nullptr), "MPI_Init");
            owns_ = true;
        }
        // Errors come back as codes (and become gshmem errors) instead of aborting the job.
        check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
        check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
        check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
    }
    ~Mpi() override {
        int done = 0;
        if (owns_ && MPI_Finalized(&done) == MPI_SUCCESS && !done) MPI_Finalize();
    }
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    const char *name() const override { return "mpi"; }
    void allgather(const void *mine, void *all, std::size_t bytes) override {
        if (bytes > (std::size_t)INT32_MAX) throw Error("MPI all-gather of more than 2 GiB per rank");
        check(MPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, MPI_COMM_WORLD), "MPI_Allgather");
    }
    void barrier() override { check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }

  private:
    int rank_ = 0, size_ = 0;
    bool owns_ = false;
};

} // namespace

std::unique_ptr<Bootstrap> mpi_bootstrap() { return std::make_unique<Mpi>(); }

#else

std::unique_ptr<Bootstrap> mpi_bootstrap() { return nullptr; }

#endif

} // namespace gshmem
