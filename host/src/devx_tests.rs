//! Tests of the library over the DevX boundary: a recording device wraps the soft device and
//! shows the commands the library sends.
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use gdaki_devx::*;
use gdaki_layout::prm::command::{self, AddressPath, AtomicCaps};
use gdaki_layout::prm::layout::cmd_in;
use gdaki_layout::prm::{self, CmdError, Opcode};
use gdaki_soft::SoftDevice;

use crate::{lock, Access, Context, ContextOptions, Provider, QpConfig, QpState};

/// A device that records every call and passes it on to the soft firmware: the sequence a
/// ConnectX gets from the same generic code.
pub(crate) struct Recording {
    inner: Arc<SoftDevice>,
    calls: Mutex<Vec<String>>,
    /// A command to refuse, as firmware would (`BAD_PARAM_ERR`).
    refuse: Mutex<Option<Opcode>>,
    /// Accept umems in GPU memory as a NIC does (through dma-buf): the soft firmware, which
    /// reads queues with the CPU, is given a host stand-in of the same size instead, so
    /// queues are created and moved through their states, but nothing is served from them.
    stand_in_for_gpu_umems: bool,
    /// Every modify command's input mailbox, in order.
    modifies: Mutex<Vec<Vec<u8>>>,
    /// Every create command's input mailbox, in order.
    creates: Mutex<Vec<Vec<u8>>>,
    /// Answer the second general capabilities without the reliable doorbell, as a ConnectX-7.
    no_reliable_doorbell: bool,
}

impl Recording {
    fn note(&self, call: impl Into<String>) {
        lock(&self.calls).push(call.into());
    }
    fn create(&self, input: &[u8], out: &mut [u8]) -> Result<u64, DeviceError> {
        let op = command::opcode(input);
        self.note(op.name());
        lock(&self.creates).push(input.to_vec());
        if *lock(&self.refuse) == Some(op) {
            let error = CmdError {
                opcode: op,
                status: gdaki_layout::prm::CmdStatus::BadParam,
                syndrome: 0x1234,
            };
            command::fail(out, error.status, error.syndrome);
            return Err(DeviceError::Command {
                error,
                detail: Some("refused by the test".into()),
            });
        }
        self.inner.obj_create(input, out)
    }
    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.calls))
    }
}

impl Device for Recording {
    fn general_cmd(&self, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.note(command::opcode(input).name());
        self.inner.general_cmd(input, out)?;
        let kind = command::cap_query(prm::get(input, cmd_in::OP_MOD) as u16).0;
        if self.no_reliable_doorbell && kind == command::CapType::General2 as u16 {
            command::GeneralCaps2::default().encode(out);
        }
        Ok(())
    }
    fn alloc_pd(&self) -> Result<u32, DeviceError> {
        self.note("alloc_pd");
        self.inner.alloc_pd()
    }
    fn dealloc_pd(&self, pd: u32) -> Result<(), DeviceError> {
        self.note("dealloc_pd");
        self.inner.dealloc_pd(pd)
    }
    fn alloc_uar(&self) -> Result<Uar, DeviceError> {
        self.note("alloc_uar");
        self.inner.alloc_uar()
    }
    fn free_uar(&self, uar: &Uar) {
        self.note("free_uar");
        self.inner.free_uar(uar)
    }
    fn query_eqn(&self) -> Result<u32, DeviceError> {
        self.note("query_eqn");
        self.inner.query_eqn()
    }
    fn umem_reg(&self, mem: &Memory) -> Result<u32, DeviceError> {
        match mem.kind() {
            MemoryKind::Gpu(_) if self.stand_in_for_gpu_umems => {
                self.note(format!("umem_reg(gpu, {} bytes)", mem.len()));
                let stand_in = Arc::new(HostBuffer::new("a GPU umem's stand-in", mem.len() as usize).unwrap());
                // SAFETY: the whole stand-in buffer, which `keep` holds.
                let host = unsafe {
                    Memory::new(
                        stand_in.addr(),
                        stand_in.size() as u64,
                        MemoryKind::Host { gpu_mapped: false },
                        Some(stand_in),
                    )
                };
                self.inner.umem_reg(&host)
            }
            _ => {
                self.note("umem_reg");
                self.inner.umem_reg(mem)
            }
        }
    }
    fn umem_dereg(&self, id: u32) -> Result<(), DeviceError> {
        self.note("umem_dereg");
        self.inner.umem_dereg(id)
    }
    fn obj_create(&self, input: &[u8], out: &mut [u8]) -> Result<u64, DeviceError> {
        self.create(input, out)
    }
    fn obj_modify(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.note(command::opcode(input).name());
        lock(&self.modifies).push(input.to_vec());
        self.inner.obj_modify(handle, input, out)
    }
    fn obj_query(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.note(command::opcode(input).name());
        self.inner.obj_query(handle, input, out)
    }
    fn obj_destroy(&self, handle: u64) -> Result<(), DeviceError> {
        self.note("destroy");
        self.inner.obj_destroy(handle)
    }
    fn query_port(&self) -> Result<Port, DeviceError> {
        self.note("query_port");
        self.inner.query_port()
    }
    fn reg_mr(&self, pd: u32, mem: &Memory, access: Access) -> Result<Mr, DeviceError> {
        self.note("reg_mr");
        self.inner.reg_mr(pd, mem, access)
    }
    fn dereg_mr(&self, mr: &Mr) -> Result<(), DeviceError> {
        self.note("dereg_mr");
        self.inner.dereg_mr(mr)
    }
    fn name(&self) -> String {
        self.inner.name()
    }
    fn transport_addr(&self) -> Option<SocketAddr> {
        self.inner.transport_addr()
    }
    fn transport_secret(&self, qpn: u32) -> u64 {
        self.inner.transport_secret(qpn)
    }
    fn resolve(&self, peer: &Endpoint) -> Result<AddressPath, DeviceError> {
        self.note("resolve");
        self.inner.resolve(peer)
    }
}

fn recording_context() -> (Context, Arc<Recording>) {
    recording_context_with(false)
}

/// A context on a [`Recording`] device; `stand_in_for_gpu_umems`: see there.
pub(crate) fn recording_context_with(stand_in_for_gpu_umems: bool) -> (Context, Arc<Recording>) {
    recording_context_of(stand_in_for_gpu_umems, false)
}

/// A context on a [`Recording`] device, which withholds the reliable doorbell if
/// `no_reliable_doorbell`.
fn recording_context_of(stand_in_for_gpu_umems: bool, no_reliable_doorbell: bool) -> (Context, Arc<Recording>) {
    let rec = Arc::new(Recording {
        inner: Arc::new(SoftDevice::open(Default::default(), Default::default(), Default::default()).unwrap()),
        calls: Mutex::new(Vec::new()),
        refuse: Mutex::new(None),
        stand_in_for_gpu_umems,
        modifies: Mutex::new(Vec::new()),
        creates: Mutex::new(Vec::new()),
        no_reliable_doorbell,
    });
    let ctx = Context::open_on(rec.clone(), ContextOptions::default(), Provider::Soft).unwrap();
    (ctx, rec)
}

/// The generic objects send a ConnectX the sequence rdma-core's DevX RC test and NVSHMEM's
/// IBGDA send (../shared/reference/mlx5-devx.md), and give everything back in reverse.
#[test]
fn queues_send_the_devx_sequence_a_connectx_expects() {
    let (ctx, rec) = recording_context();
    assert_eq!(
        rec.take(),
        [
            "QUERY_HCA_CAP",
            "QUERY_HCA_CAP",
            "QUERY_HCA_CAP", // RoCE's: the soft device's port is Ethernet
            "QUERY_HCA_CAP", // the second general ones: the soft device has them
            "query_eqn",
            "query_port",
            "alloc_uar",
            "alloc_pd"
        ]
    );
    let cq = ctx.create_cq(64).unwrap();
    assert_eq!(rec.take(), ["umem_reg", "CREATE_CQ"]);
    let qp = ctx
        .create_qp(
            &cq,
            QpConfig {
                sq_size: 64,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(rec.take(), ["umem_reg", "alloc_uar", "CREATE_QP"]);
    qp.connect(&qp.endpoint()).unwrap();
    assert_eq!(rec.take(), ["RST2INIT_QP", "resolve", "INIT2RTR_QP", "RTR2RTS_QP"]);
    assert_eq!(qp.state(), QpState::Rts);
    assert_eq!(rec.take(), ["QUERY_QP"]);

    // A put through the queues the commands made, on a region the device registered.
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    assert_eq!(rec.take(), ["reg_mr"]);
    // SAFETY: one poster; the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    dev.wait(dev.put(mr.remote(2048), mr.local(0), 64).unwrap()).unwrap();
    assert_eq!(cq.written().unwrap(), 1);
    assert_eq!(rec.take(), ["QUERY_CQ"]);

    qp.to_error().unwrap();
    assert_eq!(qp.error(), Some(gdaki_layout::Syndrome::WrFlush));
    assert_eq!(rec.take(), ["2ERR_QP", "QUERY_QP"]);
    drop(cq); // the QP keeps its CQ until it goes
    assert_eq!(rec.take(), Vec::<String>::new());
    drop(qp);
    assert_eq!(
        rec.take(),
        ["destroy", "free_uar", "umem_dereg", "destroy", "umem_dereg"],
        "the QP, its UAR and umem, then its CQ and the CQ's umem"
    );
    drop(mr);
    assert_eq!(rec.take(), ["dereg_mr"]);
    // A second protection domain on the same device: its own PD, nothing else opened
    // again, given back when it and its regions are gone.
    let tenant = ctx.alloc_pd().unwrap();
    assert_eq!(rec.take(), ["alloc_pd"]);
    assert_ne!(tenant.pd(), ctx.pd());
    let theirs = tenant.alloc_region(4096, Access::ALL).unwrap();
    drop(tenant);
    assert_eq!(rec.take(), ["reg_mr"], "the region holds its PD");
    drop(theirs);
    assert_eq!(rec.take(), ["dereg_mr", "dealloc_pd"]);
    drop(ctx);
    assert_eq!(
        rec.take(),
        ["dealloc_pd", "free_uar"],
        "the PD, then the CQs' UAR page go with the context"
    );
}

/// A reliable doorbell reaches the device as `qpc.send_dbr_mode` NO_DBR_EXT and a handle that
/// names no record; without the capability (a ConnectX-7) it is refused before anything is
/// created, and it is off by default.
#[test]
fn a_reliable_doorbell_is_asked_of_the_device_only_where_it_has_one() {
    use gdaki_layout::prm::layout::{create_qp_in, qpc};
    assert!(!QpConfig::default().reliable_doorbell);
    let (ctx, rec) = recording_context();
    assert!(ctx.supports_reliable_doorbell());
    let dbr_mode = |rec: &Recording| {
        let creates = lock(&rec.creates);
        let qp = creates
            .iter()
            .rev()
            .find(|c| command::opcode(c) == Opcode::CreateQp)
            .unwrap();
        prm::get(qp, qpc::SEND_DBR_MODE.within(create_qp_in::QPC)) as u8
    };
    for reliable in [false, true] {
        let cfg = QpConfig {
            sq_size: 16,
            reliable_doorbell: reliable,
            ..Default::default()
        };
        let qp = ctx.create_qp(&ctx.create_cq(16).unwrap(), cfg).unwrap();
        assert_eq!(dbr_mode(&rec), reliable as u8, "send_dbr_mode");
        // SAFETY: the CPU handle, read whole.
        let h = unsafe { qp.device_handle().read() };
        assert_eq!(h.no_doorbell_record(), reliable, "the handle names a record or none");
    }
    let (ctx, rec) = recording_context_of(false, true);
    assert!(!ctx.supports_reliable_doorbell());
    let cq = ctx.create_cq(16).unwrap();
    rec.take();
    let cfg = QpConfig {
        sq_size: 16,
        reliable_doorbell: true,
        ..Default::default()
    };
    let err = ctx.create_qp(&cq, cfg).unwrap_err();
    assert!(
        matches!(err, crate::Error::Unsupported { .. }) && err.to_string().contains("send_dbr_mode_no_dbr_ext"),
        "{err}"
    );
    assert!(rec.take().is_empty(), "nothing asked of the device");
}

/// A collapsed CQ is asked of the device as DOCA asks it (`cc` and `oi`, the ring the caller
/// sized) and handed to posters as one entry; a plain CQ asks neither.
#[test]
fn a_collapsed_cq_asks_cc_and_oi_and_posters_read_one_entry() {
    use gdaki_layout::prm::layout::{cqc, create_cq_in};
    let (ctx, rec) = recording_context();
    let last_cq = |rec: &Recording| {
        let creates = lock(&rec.creates);
        let cq = creates
            .iter()
            .rev()
            .find(|c| command::opcode(c) == Opcode::CreateCq)
            .unwrap()
            .clone();
        [cqc::CC, cqc::OI, cqc::LOG_CQ_SIZE].map(|b| prm::get(&cq, b.within(create_cq_in::CQ_CONTEXT)))
    };
    for collapsed in [false, true] {
        let cq = if collapsed {
            ctx.create_collapsed_cq_in(32, &crate::Rings::Host).unwrap()
        } else {
            ctx.create_cq(32).unwrap()
        };
        assert_eq!(
            last_cq(&rec),
            [collapsed as u64, collapsed as u64, 5],
            "cc, oi, log_cq_size"
        );
        assert_eq!((cq.collapsed(), cq.size()), (collapsed, 32));
        let qp = ctx
            .create_qp(
                &cq,
                QpConfig {
                    sq_size: 32,
                    ..Default::default()
                },
            )
            .unwrap();
        // SAFETY: the CPU handle, read whole.
        let h = unsafe { qp.device_handle().read() };
        assert_eq!(
            h.cq.log_size,
            if collapsed { 0 } else { 5 },
            "entries posters read, as log2"
        );
    }
}

/// The report names what gdaki needs and judges each requirement: the soft device meets
/// them all; a device with smaller caps is limited, one without version-1 CQEs unusable.
#[test]
fn the_device_report_judges_each_requirement() {
    let (ctx, _rec) = recording_context();
    let rep = ctx.device_report();
    assert!(rep.usable() && rep.requirements.iter().all(|r| r.met), "{rep:#?}");
    assert_eq!((rep.name.as_str(), rep.port, rep.link_layer), ("soft", 1, "Ethernet"));
    assert!(rep.gid.starts_with("fe80::"), "{}", rep.gid);

    let mut opened = Devx::open(Arc::new(
        SoftDevice::open(Default::default(), Default::default(), Default::default()).unwrap(),
    ))
    .unwrap();
    opened.caps.general.log_max_qp_sz = 10;
    opened.caps.atomic.operations = AtomicCaps::FETCH_ADD;
    // A ConnectX-7: no reliable doorbell; and a device without Core-Direct.
    opened.caps.general2.send_dbr_mode_no_dbr_ext = false;
    opened.caps.general.cd = false;
    let rep = opened.report();
    let unmet: Vec<_> = rep.requirements.iter().filter(|r| !r.met).map(|r| r.what).collect();
    assert_eq!(
        unmet,
        [
            "atomics on RC QPs",
            "Core-Direct WAIT",
            "reliable doorbell",
            "send queue size"
        ]
    );
    let rd = rep.requirements.iter().find(|r| r.what == "reliable doorbell").unwrap();
    assert!(rd.without.contains("reliable_doorbell is refused"), "{rd:?}");
    // Each limit says what it costs: a smaller send queue limits -t, not the message size.
    let sq = rep.requirements.iter().find(|r| r.what == "send queue size").unwrap();
    assert!(
        sq.without.contains("send queue") && !sq.without.contains("split"),
        "{sq:?}"
    );
    assert!(rep.usable(), "limits, not blockers");
    opened.caps.general.cqe_version = 0;
    assert!(!opened.report().usable());
}

/// A device's refusal reaches the caller as `Error::Device` with the command, status and
/// syndrome, and the half-made queue is given back: the CQ serves the next QP.
#[test]
fn a_refused_create_gives_back_what_it_took() {
    let (ctx, rec) = recording_context();
    let cq = ctx.create_cq(16).unwrap();
    let cfg = QpConfig {
        sq_size: 16,
        ..Default::default()
    };
    rec.take();
    *lock(&rec.refuse) = Some(Opcode::CreateQp);
    let err = ctx.create_qp(&cq, cfg.clone()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, crate::Error::Device { .. }), "{text}");
    assert!(
        text.contains("CREATE_QP") && text.contains("BAD_PARAM") && text.contains("0x00001234"),
        "{text}"
    );
    assert_eq!(
        rec.take(),
        ["umem_reg", "alloc_uar", "CREATE_QP", "free_uar", "umem_dereg"]
    );
    *lock(&rec.refuse) = None;
    let qp = ctx.create_qp(&cq, cfg.clone()).unwrap();
    qp.connect(&qp.endpoint()).unwrap();
    // gdaki's own limits are checked before the device is asked.
    rec.take();
    assert!(matches!(ctx.create_cq(3), Err(crate::Error::BadSize { .. })));
    assert!(matches!(ctx.create_qp(&cq, cfg), Err(crate::Error::CqInUse { .. })));
    assert!(rec.take().is_empty());
}

/// GPU 0 for a unit test, or `None` after printing a `SKIPPED` line where there is no usable
/// GPU; with `GDAKI_REQUIRE_GPU=1` (the GPU runner sets it) a missing GPU fails the test.
pub(crate) fn gpu_or_skip(test: &str) -> Option<gdaki_cuda::Gpu> {
    use std::io::Write;
    match gdaki_cuda::Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(e) if std::env::var("GDAKI_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("GDAKI_REQUIRE_GPU=1 but no usable GPU: {e}")
        }
        Err(e) => {
            // The raw handle: the harness captures eprintln! of passing tests.
            let _ = writeln!(std::io::stderr(), "SKIPPED (no usable GPU): {test}: {e}");
            None
        }
    }
}

/// Outstanding READs and atomics: the responder side (INIT2RTR's `log_rra_max`) takes what the
/// device allows, the endpoint says so, and the requester side (RTR2RTS's `log_sra_max`) stays
/// within what the peer's endpoint says it accepts. Both were 0: one READ or atomic in flight
/// per QP, where NVSHMEM runs with the device's limits.
#[test]
fn outstanding_reads_and_atomics_follow_the_caps_and_the_peer() {
    use gdaki_layout::prm::get;
    use gdaki_layout::prm::layout::{modify_qp_in, qpc};
    let (ctx, rec) = recording_context();
    let field = |input: &[u8], f: gdaki_layout::prm::Bits| get(input, f.within(modify_qp_in::QPC));
    for (peer_says, want_sra) in [(7u8, 7u64), (3, 3), (0, 0)] {
        let cq = ctx.create_cq(64).unwrap();
        let qp = ctx
            .create_qp(
                &cq,
                QpConfig {
                    sq_size: 64,
                    ..Default::default()
                },
            )
            .unwrap();
        // The soft device allows 2^16 each way; a QP context holds 2^7.
        assert_eq!(qp.endpoint().rd_atomic, 7);
        lock(&rec.modifies).clear();
        let peer = Endpoint {
            rd_atomic: peer_says,
            ..qp.endpoint()
        };
        qp.connect(&peer).unwrap();
        let m = lock(&rec.modifies).clone();
        let (rtr, rts) = (&m[1], &m[2]);
        assert_eq!(command::opcode(rtr), Opcode::Init2RtrQp);
        assert_eq!(field(rtr, qpc::LOG_RRA_MAX), 7, "responder resources");
        assert_eq!(command::opcode(rts), Opcode::Rtr2RtsQp);
        assert_eq!(field(rts, qpc::LOG_SRA_MAX), want_sra, "peer accepts 2^{peer_says}");
    }
}
