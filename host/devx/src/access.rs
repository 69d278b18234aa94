//! What a registered range allows.
bitflags::bitflags! {
    /// What a memory region allows (the verbs access flags).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local HCA may write it (RDMA READ destinations, atomic results).
        const LOCAL_WRITE = 1 << 0;
        /// Peers may write it (RDMA WRITE targets).
        const REMOTE_WRITE = 1 << 1;
        /// Peers may read it (RDMA READ sources).
        const REMOTE_READ = 1 << 2;
        /// Peers may run atomics on it.
        const REMOTE_ATOMIC = 1 << 3;
    }
}

impl Access {
    /// Everything: what perftests and examples register.
    pub const ALL: Access = Access::all();
}
