//! `gdaki-mlx5`: the real mlx5 device behind the DevX boundary (`gdaki-devx`): a ConnectX NIC opened for DevX through
//! libibverbs and libmlx5, both loaded at run time ([`mlx5_sys`] declares what is used), so a
//! binary starts, and the soft device works, where rdma-core is missing.
//!
//! Every command is the mailbox the generic queues built, passed to `mlx5dv_devx_*` unchanged;
//! what a ConnectX answers (status, syndrome) comes back the same way the soft firmware's does.
//! The calls around the commands (PD number, UAR page, EQ, umems, port, GID, and the RoCE next
//! hop's MAC through an address handle) are the ones rdma-core's DevX RC test and NVSHMEM's
//! IBGDA make (see `docs/devx-provider.md`); memory regions are verbs MRs (`ibv_reg_mr`, and
//! `ibv_reg_dmabuf_mr` over a dma-buf export for GPU memory).
#![warn(missing_docs)]

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CStr};
use std::os::fd::AsRawFd;
use std::sync::{Mutex, OnceLock};

use gdaki_layout::prm::command::{self, AddressPath};
use mlx5_sys as sys;

use gdaki_cuda::DmaBuf;
use gdaki_devx::util::lock;
use gdaki_devx::{Access, Device, DeviceError, Endpoint, LinkLayer, Memory, MemoryKind, Mr, Port, Uar};

/// The port gdaki uses.
const PORT: u8 = 1;

/// The variable that picks the GID table index (RoCE: else the first RoCE v2 GID, IPv4-mapped
/// ones first; InfiniBand: else 0).
pub const GID_INDEX_VAR: &str = "GDAKI_GID_INDEX";

/// The resolved entry points of libibverbs and libmlx5.
struct Lib {
    get_device_list: sys::ibv_get_device_list,
    free_device_list: sys::ibv_free_device_list,
    get_device_name: sys::ibv_get_device_name,
    close_device: sys::ibv_close_device,
    alloc_pd: sys::ibv_alloc_pd,
    dealloc_pd: sys::ibv_dealloc_pd,
    query_port: sys::ibv_query_port,
    query_gid: sys::ibv_query_gid,
    create_ah: sys::ibv_create_ah,
    destroy_ah: sys::ibv_destroy_ah,
    is_supported: sys::mlx5dv_is_supported,
    open_device: sys::mlx5dv_open_device,
    init_obj: sys::mlx5dv_init_obj,
    general_cmd: sys::mlx5dv_devx_general_cmd,
    obj_create: sys::mlx5dv_devx_obj_create,
    obj_modify: sys::mlx5dv_devx_obj_cmd,
    obj_query: sys::mlx5dv_devx_obj_cmd,
    obj_destroy: sys::mlx5dv_devx_obj_destroy,
    umem_reg: sys::mlx5dv_devx_umem_reg,
    umem_dereg: sys::mlx5dv_devx_umem_dereg,
    /// Absent before rdma-core 35: GPU-memory rings are then refused.
    umem_reg_ex: Option<sys::mlx5dv_devx_umem_reg_ex>,
    reg_mr: sys::ibv_reg_mr,
    /// Absent before rdma-core 34: GPU-memory regions are then refused.
    reg_dmabuf_mr: Option<sys::ibv_reg_dmabuf_mr>,
    dereg_mr: sys::ibv_dereg_mr,
    alloc_uar: sys::mlx5dv_devx_alloc_uar,
    free_uar: sys::mlx5dv_devx_free_uar,
    query_eqn: sys::mlx5dv_devx_query_eqn,
    // The function pointers above point into these: they stay loaded for the process's life.
    _verbs: libloading::Library,
    _mlx5: libloading::Library,
}

fn call_error(what: &'static str, why: impl Into<String>) -> DeviceError {
    DeviceError::Call { what, why: why.into() }
}

impl Lib {
    /// The libraries, loaded once per process.
    fn get() -> Result<&'static Lib, DeviceError> {
        static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
        LIB.get_or_init(Lib::load)
            .as_ref()
            .map_err(|why| call_error("loading rdma-core", why.clone()))
    }

    fn load() -> Result<Lib, String> {
        let open = |name: &str| {
            // SAFETY: loading rdma-core runs its constructors, which only set up its tables.
            unsafe { libloading::Library::new(name) }
                .map_err(|e| format!("{name}: {e} (install rdma-core: libibverbs1 and ibverbs-providers)"))
        };
        let verbs = open(sys::symbols::LIBIBVERBS)?;
        let mlx5 = open(sys::symbols::LIBMLX5)?;
        macro_rules! sym {
            ($lib:expr, $name:literal) => {
                // SAFETY: the symbol is declared in mlx5-sys with the type rdma-core gives it
                // (checked against its headers by mlx5-sys's layout test).
                *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: no {} ({e}); rdma-core too old?", stringify!($lib), $name))?
            };
        }
        macro_rules! optional {
            ($lib:expr, $name:literal) => {
                // SAFETY: as in `sym!`.
                unsafe { $lib.get(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|f| *f)
            };
        }
        Ok(Lib {
            umem_reg_ex: optional!(mlx5, "mlx5dv_devx_umem_reg_ex"),
            reg_mr: sym!(verbs, "ibv_reg_mr"),
            reg_dmabuf_mr: optional!(verbs, "ibv_reg_dmabuf_mr"),
            dereg_mr: sym!(verbs, "ibv_dereg_mr"),
            get_device_list: sym!(verbs, "ibv_get_device_list"),
            free_device_list: sym!(verbs, "ibv_free_device_list"),
            get_device_name: sym!(verbs, "ibv_get_device_name"),
            close_device: sym!(verbs, "ibv_close_device"),
            alloc_pd: sym!(verbs, "ibv_alloc_pd"),
            dealloc_pd: sym!(verbs, "ibv_dealloc_pd"),
            query_port: sym!(verbs, "ibv_query_port"),
            query_gid: sym!(verbs, "ibv_query_gid"),
            create_ah: sym!(verbs, "ibv_create_ah"),
            destroy_ah: sym!(verbs, "ibv_destroy_ah"),
            is_supported: sym!(mlx5, "mlx5dv_is_supported"),
            open_device: sym!(mlx5, "mlx5dv_open_device"),
            init_obj: sym!(mlx5, "mlx5dv_init_obj"),
            general_cmd: sym!(mlx5, "mlx5dv_devx_general_cmd"),
            obj_create: sym!(mlx5, "mlx5dv_devx_obj_create"),
            obj_modify: sym!(mlx5, "mlx5dv_devx_obj_modify"),
            obj_query: sym!(mlx5, "mlx5dv_devx_obj_query"),
            obj_destroy: sym!(mlx5, "mlx5dv_devx_obj_destroy"),
            umem_reg: sym!(mlx5, "mlx5dv_devx_umem_reg"),
            umem_dereg: sym!(mlx5, "mlx5dv_devx_umem_dereg"),
            alloc_uar: sym!(mlx5, "mlx5dv_devx_alloc_uar"),
            free_uar: sym!(mlx5, "mlx5dv_devx_free_uar"),
            query_eqn: sym!(mlx5, "mlx5dv_devx_query_eqn"),
            _verbs: verbs,
            _mlx5: mlx5,
        })
    }

    /// Runs `f` over the devices libibverbs lists (name, driven by libmlx5, device), while
    /// the list (and so each device pointer) is valid.
    fn with_devices<T>(&self, f: impl FnOnce(&[Listed]) -> T) -> Result<T, DeviceError> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below, after its last use.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            let e = os_error(0);
            // ENOSYS: the kernel has no RDMA subsystem, so there is no device to list.
            if e.raw_os_error() == Some(38) {
                return Ok(f(&[]));
            }
            return Err(call_error("listing RDMA devices", e.to_string()));
        }
        let found: Vec<Listed> = (0..n.max(0) as usize)
            .map(|i| {
                // SAFETY: the list holds `n` device pointers, valid until it is freed.
                let dev = unsafe { *list.add(i) };
                // SAFETY: a listed device has a NUL-terminated name.
                let name = unsafe { CStr::from_ptr((self.get_device_name)(dev)) }
                    .to_string_lossy()
                    .into_owned();
                // SAFETY: as above.
                let mlx5 = unsafe { (self.is_supported)(dev) };
                Listed { name, mlx5, dev }
            })
            .collect();
        let out = f(&found);
        // SAFETY: the list came from ibv_get_device_list; contexts opened in `f` outlive it.
        unsafe { (self.free_device_list)(list) };
        Ok(out)
    }
}

/// A device libibverbs lists.
struct Listed {
    name: String,
    mlx5: bool,
    dev: *mut sys::ibv_device,
}

/// What the device keeps per object kind, by the handle or id it gave out.
#[derive(Default)]
struct Tables {
    /// Object handle (the `mlx5dv_devx_obj` pointer) → nothing: the set of live handles.
    objects: HashSet<u64>,
    /// Umem id → (its `mlx5dv_devx_umem`, the memory it keeps alive).
    umems: HashMap<u32, (usize, Memory)>,
    /// MR handle (the `ibv_mr` pointer) → the memory it keeps alive.
    mrs: HashMap<u64, Memory>,
    /// UAR page id → its `mlx5dv_devx_uar`.
    uars: HashMap<u32, usize>,
    /// PD number → its `ibv_pd`, for the PDs [`Device::alloc_pd`] gave out.
    pds: HashMap<u32, usize>,
}

/// A ConnectX opened for DevX.
pub struct Mlx5Device {
    lib: &'static Lib,
    name: String,
    ctx: *mut sys::ibv_context,
    pd: *mut sys::ibv_pd,
    port: Port,
    /// Ethernet: whether the port's GID is a RoCE v2 one (UDP-encapsulated); v1 otherwise.
    roce_v2: bool,
    tables: Mutex<Tables>,
}

// SAFETY: libibverbs contexts, PDs and DevX objects may be used from any thread (rdma-core
// locks what it shares); the tables are behind a mutex.
unsafe impl Send for Mlx5Device {}
// SAFETY: as above.
unsafe impl Sync for Mlx5Device {}

/// The error of a call that returned `rc`: a positive `rc` is the errno itself (DevX calls),
/// otherwise the call left it in `errno` (calls that return a null pointer or -1).
fn os_error(rc: i32) -> std::io::Error {
    if rc > 0 {
        std::io::Error::from_raw_os_error(rc)
    } else {
        std::io::Error::last_os_error()
    }
}

impl Mlx5Device {
    /// Opens `name` (else the first device libmlx5 drives) for DevX, with a PD and its port.
    pub fn open(name: Option<&str>) -> Result<Mlx5Device, DeviceError> {
        let lib = Lib::get()?;
        let what = "opening an mlx5 device";
        let (name, ctx) = lib.with_devices(|devices| {
            let Some(chosen) = devices
                .iter()
                .find(|d| d.mlx5 && name.is_none_or(|want| want == d.name))
            else {
                return Err(call_error(
                    what,
                    match name {
                        Some(want) => format!("no mlx5 device {want:?} (devices: {})", names(devices)),
                        None => format!("no device libmlx5 drives (devices: {})", names(devices)),
                    },
                ));
            };
            let mut attr = sys::mlx5dv_context_attr {
                flags: sys::MLX5DV_CONTEXT_FLAGS_DEVX,
                comp_mask: 0,
            };
            // SAFETY: the device pointer is valid while the list is held (inside `with_devices`).
            let ctx = unsafe { (lib.open_device)(chosen.dev, &mut attr) };
            if ctx.is_null() {
                return Err(call_error(
                    what,
                    format!(
                        "{}: DevX open failed ({}): the kernel driver or firmware does not allow DevX \
                         for this user",
                        chosen.name,
                        os_error(0)
                    ),
                ));
            }
            Ok((chosen.name.clone(), ctx))
        })??;
        Mlx5Device::set_up(lib, name, ctx).inspect_err(|_| {
            // SAFETY: the context was opened above and nothing else uses it.
            unsafe { (lib.close_device)(ctx) };
        })
    }

    /// A new PD on `ctx` and its number.
    fn new_pd(lib: &'static Lib, ctx: *mut sys::ibv_context) -> Result<(*mut sys::ibv_pd, u32), DeviceError> {
        let what = "allocating a protection domain";
        // SAFETY: `ctx` is an open context.
        let pd = unsafe { (lib.alloc_pd)(ctx) };
        if pd.is_null() {
            return Err(call_error(what, format!("ibv_alloc_pd: {}", os_error(0))));
        }
        let mut dv_pd = sys::mlx5dv_pd::default();
        let mut obj = empty_obj();
        obj.pd.r#in = pd;
        obj.pd.out = &mut dv_pd;
        // SAFETY: `obj` names a live PD and a place for its mlx5 view.
        let rc = unsafe { (lib.init_obj)(&mut obj, sys::MLX5DV_OBJ_PD) };
        if rc != 0 {
            // SAFETY: allocated above, used by nothing.
            unsafe { (lib.dealloc_pd)(pd) };
            return Err(call_error(what, format!("mlx5dv_init_obj(PD): {}", os_error(rc))));
        }
        Ok((pd, dv_pd.pdn))
    }

    fn set_up(lib: &'static Lib, name: String, ctx: *mut sys::ibv_context) -> Result<Mlx5Device, DeviceError> {
        // The device's own PD holds its address handles; contexts allocate theirs.
        let (pd, pdn) = Self::new_pd(lib, ctx)?;
        match query_port(lib, ctx, &name) {
            Ok(port) => {
                tracing::info!(
                    target: "gdaki::devx",
                    device = %name,
                    pdn,
                    gid_index = port.gid_index,
                    mtu = port.mtu,
                    link = ?port.link,
                    "mlx5 device opened for DevX"
                );
                let roce_v2 = port.link == LinkLayer::Ethernet && is_roce_v2(&name, port.gid_index as i32);
                Ok(Mlx5Device {
                    lib,
                    name,
                    ctx,
                    pd,
                    port,
                    roce_v2,
                    tables: Mutex::new(Tables::default()),
                })
            }
            Err(e) => {
                // SAFETY: the PD was allocated above and nothing else uses it.
                unsafe { (lib.dealloc_pd)(pd) };
                Err(e)
            }
        }
    }

    /// The result of a command call: the device's refusal (status and syndrome in `out`) when
    /// it ran and said no, else the call's own failure.
    fn ran(what: &'static str, rc: i32, input: &[u8], out: &[u8]) -> Result<(), DeviceError> {
        match rc {
            0 => Ok(()),
            _ => Err(Self::failure(what, rc, input, out)),
        }
    }

    /// Why a command call failed (`rc` as [`os_error`] reads it).
    fn failure(what: &'static str, rc: i32, input: &[u8], out: &[u8]) -> DeviceError {
        let errno = os_error(rc);
        match command::check(command::opcode(input), out) {
            Err(error) => DeviceError::Command {
                error,
                detail: Some(errno.to_string()),
            },
            Ok(()) => call_error(what, errno.to_string()),
        }
    }

    /// Runs `call` (modify or query) on the live object `handle`.
    fn obj_cmd(
        &self,
        call: sys::mlx5dv_devx_obj_cmd,
        what: &'static str,
        handle: u64,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        let obj = self.object(handle)?;
        // SAFETY: `obj` is live (in the table); the mailboxes are valid for their lengths.
        let rc = unsafe {
            call(
                obj,
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        Self::ran(what, rc, input, out)
    }

    fn object(&self, handle: u64) -> Result<*mut sys::mlx5dv_devx_obj, DeviceError> {
        if lock(&self.tables).objects.contains(&handle) {
            Ok(handle as *mut sys::mlx5dv_devx_obj)
        } else {
            Err(call_error(
                "a DevX object command",
                format!("no object {handle:#x} here"),
            ))
        }
    }
}

fn names(devices: &[Listed]) -> String {
    if devices.is_empty() {
        return "none".into();
    }
    devices
        .iter()
        .map(|d| {
            if d.mlx5 {
                d.name.clone()
            } else {
                format!("{} (not mlx5)", d.name)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn empty_obj() -> sys::mlx5dv_obj {
    use sys::mlx5dv_obj_pair as Pair;
    sys::mlx5dv_obj {
        qp: Pair::NULL,
        cq: Pair::NULL,
        srq: Pair::NULL,
        rwq: Pair::NULL,
        dm: Pair::NULL,
        ah: Pair::NULL,
        pd: Pair::NULL,
    }
}

/// Port 1: active, its MTU and link layer, and the GID gdaki sends from.
fn query_port(lib: &Lib, ctx: *mut sys::ibv_context, name: &str) -> Result<Port, DeviceError> {
    let what = "querying port 1";
    // Room past the struct: a newer library may know more fields than these headers.
    #[repr(C)]
    struct Padded {
        attr: sys::ibv_port_attr,
        _more: [u8; 64],
    }
    let mut p = Padded {
        attr: Default::default(),
        _more: [0; 64],
    };
    // SAFETY: `ctx` is open; `p` is larger than the attributes the library writes.
    let rc = unsafe { (lib.query_port)(ctx, PORT, &mut p.attr) };
    if rc != 0 {
        return Err(call_error(what, format!("ibv_query_port: {}", os_error(rc))));
    }
    let attr = p.attr;
    if attr.state != sys::IBV_PORT_ACTIVE {
        return Err(call_error(
            what,
            format!("{name} port 1 is not active (state {})", attr.state),
        ));
    }
    let link = match attr.link_layer {
        sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
        _ => LinkLayer::InfiniBand,
    };
    let gid_at = |index: i32| {
        let mut gid = sys::ibv_gid::default();
        // SAFETY: `ctx` is open and `gid` a valid out-pointer.
        let rc = unsafe { (lib.query_gid)(ctx, PORT, index, &mut gid) };
        (rc == 0).then_some(gid.raw)
    };
    let gid_index = match std::env::var(GID_INDEX_VAR).ok().map(|v| v.trim().parse::<u8>()) {
        Some(Ok(i)) => i,
        Some(Err(_)) => {
            return Err(call_error(
                what,
                format!("{GID_INDEX_VAR} is not a GID table index (0..=255)"),
            ))
        }
        None if link == LinkLayer::InfiniBand => 0,
        None => pick_roce_gid(attr.gid_tbl_len, |i| is_roce_v2(name, i), gid_at)
            .ok_or_else(|| call_error(what, format!("{name} port 1 has no RoCE v2 GID; set {GID_INDEX_VAR}")))?,
    };
    let gid = gid_at(gid_index as i32)
        .filter(|g| g.iter().any(|b| *b != 0))
        .ok_or_else(|| call_error(what, format!("{name} port 1 has no GID at index {gid_index}")))?;
    Ok(Port {
        number: PORT,
        gid,
        gid_index,
        lid: attr.lid,
        link,
        // IBV_MTU_256 is 1, each next code doubles.
        mtu: 128u32 << attr.active_mtu.clamp(1, 5),
    })
}

/// The path to `peer` from `port` as the kernel fills it (mlx5_ib's `mlx5_set_path`), given
/// the next hop's MAC `rmac` (RoCE) and a random `entropy`:
/// - InfiniBand: the peer's LID; the GRH bit only where the peer is on another subnet.
/// - RoCE: the MAC, no GRH bit (it is InfiniBand's; RoCE packets carry a GRH regardless, and
///   the path's GID fields say what goes in it), and for a RoCE v2 GID a UDP source port in
///   0xc000..=0xffff that spreads flows; 0 for a RoCE v1 GID, which has no UDP header.
fn address_path(port: &Port, roce_v2: bool, peer: &Endpoint, rmac: [u8; 6], entropy: u16) -> AddressPath {
    let mut path = AddressPath {
        port: port.number,
        gid_index: port.gid_index,
        rgid: peer.gid,
        hop_limit: 64,
        ..Default::default()
    };
    match port.link {
        LinkLayer::InfiniBand => {
            path.rlid = peer.lid;
            path.grh = peer.gid[..8] != port.gid[..8];
        }
        LinkLayer::Ethernet => {
            path.rmac = rmac;
            if roce_v2 {
                path.udp_sport = 0xc000 | (entropy & 0x3fff);
            }
        }
    }
    path
}

/// Whether GID `index` of port 1 of device `name` is a RoCE v2 GID (sysfs says).
fn is_roce_v2(name: &str, index: i32) -> bool {
    std::fs::read_to_string(format!(
        "/sys/class/infiniband/{name}/ports/{PORT}/gid_attrs/types/{index}"
    ))
    .is_ok_and(|t| t.trim().eq_ignore_ascii_case("RoCE v2"))
}

/// The first non-zero RoCE v2 GID of a table of `table_len`, IPv4-mapped ones first (what
/// perftest users pick with `-x`).
fn pick_roce_gid(
    table_len: i32,
    roce_v2: impl Fn(i32) -> bool,
    gid_at: impl Fn(i32) -> Option<[u8; 16]>,
) -> Option<u8> {
    let mut first = None;
    for i in (0..table_len.clamp(0, 256)).filter(|&i| roce_v2(i)) {
        let Some(gid) = gid_at(i).filter(|g| g.iter().any(|b| *b != 0)) else {
            continue;
        };
        if gid[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff] {
            return Some(i as u8);
        }
        first.get_or_insert(i as u8);
    }
    first
}

/// The verbs access flags of `access` (the same bits, named here so a change to either shows).
fn ibv_access(access: Access) -> i32 {
    let mut flags = 0;
    for (ours, verbs) in [
        (Access::LOCAL_WRITE, sys::IBV_ACCESS_LOCAL_WRITE),
        (Access::REMOTE_WRITE, sys::IBV_ACCESS_REMOTE_WRITE),
        (Access::REMOTE_READ, sys::IBV_ACCESS_REMOTE_READ),
        (Access::REMOTE_ATOMIC, sys::IBV_ACCESS_REMOTE_ATOMIC),
    ] {
        if access.contains(ours) {
            flags |= verbs;
        }
    }
    // Remote write and atomic access need local write (the verbs rule: the kernel refuses
    // the registration otherwise).
    if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) {
        flags |= sys::IBV_ACCESS_LOCAL_WRITE;
    }
    flags as i32
}

impl Drop for Mlx5Device {
    fn drop(&mut self) {
        let mut t = lock(&self.tables);
        if !t.objects.is_empty() || !t.umems.is_empty() || !t.uars.is_empty() || !t.mrs.is_empty() {
            tracing::warn!(
                target: "gdaki::devx",
                objects = t.objects.len(),
                umems = t.umems.len(),
                regions = t.mrs.len(),
                uars = t.uars.len(),
                "mlx5 device closed with resources still held"
            );
        }
        for (_, pd) in t.pds.drain() {
            // SAFETY: PDs alloc_pd made that no context gave back; nothing uses them now.
            unsafe { (self.lib.dealloc_pd)(pd as *mut sys::ibv_pd) };
        }
        drop(t);
        // SAFETY: the PD and the context were made in `open`; every queue (which holds the
        // device alive) is gone.
        unsafe {
            (self.lib.dealloc_pd)(self.pd);
            (self.lib.close_device)(self.ctx);
        }
    }
}

impl Device for Mlx5Device {
    fn general_cmd(&self, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: the mailboxes are valid for their lengths; `ctx` is open.
        let rc = unsafe {
            (self.lib.general_cmd)(
                self.ctx,
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        Self::ran("mlx5dv_devx_general_cmd", rc, input, out)
    }

    fn alloc_pd(&self) -> Result<u32, DeviceError> {
        let (pd, pdn) = Self::new_pd(self.lib, self.ctx)?;
        lock(&self.tables).pds.insert(pdn, pd as usize);
        Ok(pdn)
    }

    fn dealloc_pd(&self, pdn: u32) -> Result<(), DeviceError> {
        let mut t = lock(&self.tables);
        let Some(&pd) = t.pds.get(&pdn) else {
            return Err(call_error("ibv_dealloc_pd", format!("no protection domain {pdn:#x}")));
        };
        // SAFETY: a PD alloc_pd made; the verbs library refuses (EBUSY) while a region or QP
        // uses it, and it stays in the table then.
        let rc = unsafe { (self.lib.dealloc_pd)(pd as *mut sys::ibv_pd) };
        if rc != 0 {
            return Err(call_error("ibv_dealloc_pd", os_error(rc).to_string()));
        }
        t.pds.remove(&pdn);
        Ok(())
    }

    fn alloc_uar(&self) -> Result<Uar, DeviceError> {
        // Non-cached first (a GPU's doorbell stores must not be combined), else blue flame.
        let uar = [sys::MLX5DV_UAR_ALLOC_TYPE_NC, sys::MLX5DV_UAR_ALLOC_TYPE_BF]
            .into_iter()
            // SAFETY: `ctx` is open.
            .map(|kind| unsafe { (self.lib.alloc_uar)(self.ctx, kind) })
            .find(|u| !u.is_null())
            .ok_or_else(|| call_error("allocating a UAR page", os_error(0).to_string()))?;
        // SAFETY: the library returned a valid UAR description.
        let u = unsafe { &*uar };
        let base = u.reg_addr as u64 & !4095;
        lock(&self.tables).uars.insert(u.page_id, uar as usize);
        Ok(Uar {
            page: u.page_id,
            base,
            reg_offset: u.reg_addr as u64 - base,
            dbr_less_offset: gdaki_layout::doorbell::UAR_DBR_LESS_OFFSET as u64,
            size: 4096,
            io: true,
        })
    }

    fn free_uar(&self, uar: &Uar) {
        if let Some(ptr) = lock(&self.tables).uars.remove(&uar.page) {
            // SAFETY: allocated by alloc_uar and given back once.
            unsafe { (self.lib.free_uar)(ptr as *mut sys::mlx5dv_devx_uar) };
        }
    }

    fn query_eqn(&self) -> Result<u32, DeviceError> {
        let mut eqn = 0;
        // SAFETY: `ctx` is open; `eqn` a valid out-pointer.
        let rc = unsafe { (self.lib.query_eqn)(self.ctx, 0, &mut eqn) };
        if rc != 0 {
            return Err(call_error("mlx5dv_devx_query_eqn", os_error(rc).to_string()));
        }
        Ok(eqn)
    }

    fn umem_reg(&self, mem: &Memory) -> Result<u32, DeviceError> {
        let what = "mlx5dv_devx_umem_reg";
        let len = usize::try_from(mem.len()).map_err(|_| call_error(what, format!("{} bytes", mem.len())))?;
        let umem = match mem.kind() {
            // SAFETY: `mem` is allocated while `keep` lives, which the table holds until dereg.
            MemoryKind::Host { .. } => unsafe {
                (self.lib.umem_reg)(self.ctx, mem.addr() as *mut c_void, len, sys::IBV_ACCESS_LOCAL_WRITE)
            },
            MemoryKind::Gpu(gpu) => {
                let Some(reg_ex) = self.lib.umem_reg_ex else {
                    return Err(call_error(
                        what,
                        "GPU-memory queues need mlx5dv_devx_umem_reg_ex (rdma-core 35 or later); \
                         place rings in host memory",
                    ));
                };
                let buf = DmaBuf::export(gpu, mem.addr(), len)
                    .map_err(|e| call_error("exporting GPU memory as dma-buf", e.to_string()))?;
                let mut umem_in = sys::mlx5dv_devx_umem_in {
                    // With a dma-buf, `addr` is the offset into it.
                    addr: std::ptr::null_mut(),
                    size: len,
                    access: sys::IBV_ACCESS_LOCAL_WRITE,
                    pgsz_bitmap: !0xfff,
                    comp_mask: sys::MLX5DV_UMEM_MASK_DMABUF,
                    dmabuf_fd: buf.fd().as_raw_fd(),
                };
                // SAFETY: a valid input struct; the fd is open for the call (the umem keeps its
                // own reference to the dma-buf).
                unsafe { reg_ex(self.ctx, &mut umem_in) }
            }
        };
        if umem.is_null() {
            return Err(call_error(what, os_error(0).to_string()));
        }
        // SAFETY: the library returned a valid umem.
        let id = unsafe { (*umem).umem_id };
        lock(&self.tables).umems.insert(id, (umem as usize, mem.clone()));
        Ok(id)
    }

    fn umem_dereg(&self, id: u32) -> Result<(), DeviceError> {
        let mut t = lock(&self.tables);
        let Some(&(ptr, _)) = t.umems.get(&id) else {
            return Err(call_error("mlx5dv_devx_umem_dereg", format!("no umem {id:#x}")));
        };
        // SAFETY: registered by umem_reg and deregistered once (it leaves the table below).
        let rc = unsafe { (self.lib.umem_dereg)(ptr as *mut sys::mlx5dv_devx_umem) };
        if rc != 0 {
            return Err(call_error("mlx5dv_devx_umem_dereg", os_error(rc).to_string()));
        }
        t.umems.remove(&id);
        Ok(())
    }

    fn reg_mr(&self, pd: u32, mem: &Memory, access: Access) -> Result<Mr, DeviceError> {
        let what = "ibv_reg_mr";
        let Some(ibv_pd) = lock(&self.tables).pds.get(&pd).map(|&p| p as *mut sys::ibv_pd) else {
            return Err(call_error(what, format!("no protection domain {pd:#x} on this device")));
        };
        let len = usize::try_from(mem.len()).map_err(|_| call_error(what, format!("{} bytes", mem.len())))?;
        let flags = ibv_access(access);
        let mr = match mem.kind() {
            // SAFETY: the range stays allocated while `keep` (or the caller's contract) holds it,
            // which outlives the registration (the table keeps `keep` until dereg).
            MemoryKind::Host { .. } => unsafe { (self.lib.reg_mr)(ibv_pd, mem.addr() as *mut c_void, len, flags) },
            MemoryKind::Gpu(gpu) => {
                let Some(reg) = self.lib.reg_dmabuf_mr else {
                    return Err(call_error(
                        "ibv_reg_dmabuf_mr",
                        "GPU-memory regions need ibv_reg_dmabuf_mr (rdma-core 34 or later)",
                    ));
                };
                let (buf, offset) = DmaBuf::covering(gpu, mem.addr(), len)
                    .map_err(|e| call_error("exporting GPU memory as dma-buf", e.to_string()))?;
                // SAFETY: the fd exports the pages around the region, which starts `offset`
                // bytes in; the MR keeps its own reference to the dma-buf.
                unsafe { reg(ibv_pd, offset, len, mem.addr(), buf.fd().as_raw_fd(), flags) }
            }
        };
        if mr.is_null() {
            return Err(call_error(what, os_error(0).to_string()));
        }
        // SAFETY: the library returned a valid MR.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        lock(&self.tables).mrs.insert(mr as u64, mem.clone());
        Ok(Mr {
            handle: mr as u64,
            lkey,
            rkey,
        })
    }

    fn dereg_mr(&self, mr: &Mr) -> Result<(), DeviceError> {
        let mut t = lock(&self.tables);
        if !t.mrs.contains_key(&mr.handle) {
            return Err(call_error(
                "ibv_dereg_mr",
                format!("no region with lkey {:#x}", mr.lkey),
            ));
        }
        // SAFETY: registered by reg_mr and deregistered once (it leaves the table below).
        let rc = unsafe { (self.lib.dereg_mr)(mr.handle as *mut sys::ibv_mr) };
        if rc != 0 {
            return Err(call_error("ibv_dereg_mr", os_error(rc).to_string()));
        }
        t.mrs.remove(&mr.handle);
        Ok(())
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn obj_create(&self, input: &[u8], out: &mut [u8]) -> Result<u64, DeviceError> {
        // SAFETY: the mailboxes are valid for their lengths; `ctx` is open.
        let obj = unsafe {
            (self.lib.obj_create)(
                self.ctx,
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if obj.is_null() {
            return Err(Self::failure("mlx5dv_devx_obj_create", 0, input, out));
        }
        lock(&self.tables).objects.insert(obj as u64);
        Ok(obj as u64)
    }

    fn obj_modify(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.obj_cmd(self.lib.obj_modify, "mlx5dv_devx_obj_modify", handle, input, out)
    }

    fn obj_query(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.obj_cmd(self.lib.obj_query, "mlx5dv_devx_obj_query", handle, input, out)
    }

    fn obj_destroy(&self, handle: u64) -> Result<(), DeviceError> {
        let obj = self.object(handle)?;
        // SAFETY: `obj` is live and destroyed once (it leaves the table on success).
        let rc = unsafe { (self.lib.obj_destroy)(obj) };
        if rc != 0 {
            return Err(call_error("mlx5dv_devx_obj_destroy", os_error(rc).to_string()));
        }
        lock(&self.tables).objects.remove(&handle);
        Ok(())
    }

    fn query_port(&self) -> Result<Port, DeviceError> {
        Ok(self.port)
    }

    fn resolve(&self, peer: &Endpoint) -> Result<AddressPath, DeviceError> {
        let rmac = match self.port.link {
            LinkLayer::Ethernet => self.next_hop_mac(peer.gid)?,
            LinkLayer::InfiniBand => [0; 6],
        };
        Ok(address_path(
            &self.port,
            self.roce_v2,
            peer,
            rmac,
            gdaki_devx::util::random_u32() as u16,
        ))
    }
}

impl Mlx5Device {
    /// RoCE: the MAC of the next hop to `gid`, as the kernel resolves it for an address handle.
    fn next_hop_mac(&self, gid: [u8; 16]) -> Result<[u8; 6], DeviceError> {
        let what = "resolving a RoCE peer's MAC";
        let mut attr = sys::ibv_ah_attr {
            grh: sys::ibv_global_route {
                dgid: sys::ibv_gid { raw: gid },
                sgid_index: self.port.gid_index,
                hop_limit: 64,
                ..Default::default()
            },
            is_global: 1,
            port_num: self.port.number,
            ..Default::default()
        };
        // SAFETY: the PD is live; `attr` is a valid address description.
        let ah = unsafe { (self.lib.create_ah)(self.pd, &mut attr) };
        if ah.is_null() {
            return Err(call_error(what, format!("ibv_create_ah: {}", os_error(0))));
        }
        let mut dv_ah = sys::mlx5dv_ah {
            av: std::ptr::null_mut(),
            comp_mask: 0,
        };
        let mut obj = empty_obj();
        obj.ah.r#in = ah;
        obj.ah.out = &mut dv_ah;
        // SAFETY: `obj` names a live AH and a place for its mlx5 view.
        let rc = unsafe { (self.lib.init_obj)(&mut obj, sys::MLX5DV_OBJ_AH) };
        let mac = if rc == 0 && !dv_ah.av.is_null() {
            // SAFETY: the AH (and its address vector) lives until destroyed below.
            Ok(unsafe { (*dv_ah.av).rmac })
        } else {
            Err(call_error(what, format!("mlx5dv_init_obj(AH): {}", os_error(rc))))
        };
        // SAFETY: created above, destroyed once.
        unsafe { (self.lib.destroy_ah)(ah) };
        mac
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The path's GRH bit, MAC and UDP source port as the kernel sets them for each link and
    /// GID type: no GRH bit on RoCE (it was set), a UDP port only for RoCE v2 (it was set for
    /// v1 too, where it must stay 0).
    #[test]
    fn paths_are_filled_as_the_kernel_fills_them() {
        let port = |link| Port {
            number: 1,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            gid_index: 3,
            lid: 9,
            link,
            mtu: 4096,
        };
        let peer = |prefix: u8| Endpoint {
            gid: [prefix, 0x80, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1],
            lid: 17,
            qpn: 0x42,
            psn: 0,
            mtu: 4096,
            secret: 0,
            rd_atomic: 0,
            addr: None,
        };
        let mac = [2, 0, 0, 0, 0, 7];
        let v2 = address_path(&port(LinkLayer::Ethernet), true, &peer(0xfe), mac, 0x1234);
        assert!(!v2.grh, "RoCE: no GRH bit");
        assert_eq!((v2.rmac, v2.udp_sport, v2.rlid), (mac, 0xc000 | 0x1234, 0));
        assert_eq!((v2.gid_index, v2.rgid), (3, peer(0xfe).gid));
        let v1 = address_path(&port(LinkLayer::Ethernet), false, &peer(0xfe), mac, 0x1234);
        assert!(!v1.grh);
        assert_eq!(v1.udp_sport, 0, "RoCE v1 has no UDP header");
        let ib = address_path(&port(LinkLayer::InfiniBand), false, &peer(0xfe), [0; 6], 0x1234);
        assert_eq!((ib.grh, ib.rlid, ib.udp_sport), (false, 17, 0), "same subnet");
        let far = address_path(&port(LinkLayer::InfiniBand), false, &peer(0xfd), [0; 6], 0x1234);
        assert!(far.grh, "another subnet: a GRH");
    }

    /// On a machine without an mlx5 device (CI, the GPU machine), opening one is an error that
    /// says what is there, never a crash; where rdma-core is missing, the error says to install it.
    #[test]
    fn access_becomes_the_verbs_flags_with_local_write_where_verbs_require_it() {
        assert_eq!(ibv_access(Access::empty()), 0);
        assert_eq!(ibv_access(Access::REMOTE_READ), sys::IBV_ACCESS_REMOTE_READ as i32);
        let w = (sys::IBV_ACCESS_REMOTE_WRITE | sys::IBV_ACCESS_LOCAL_WRITE) as i32;
        assert_eq!(ibv_access(Access::REMOTE_WRITE), w);
        assert_eq!(ibv_access(Access::ALL), 0xf);
    }

    #[test]
    fn opening_with_no_device_says_why() {
        match Mlx5Device::open(None) {
            Ok(dev) => eprintln!("an mlx5 device is present: {} opened", dev.name()),
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains("no device libmlx5 drives") || text.contains("rdma-core"),
                    "{text}"
                );
            }
        }
        match Mlx5Device::open(Some("mlx5_does_not_exist")) {
            Ok(_) => panic!("opened a device that does not exist"),
            Err(e) => assert!(
                e.to_string().contains("mlx5_does_not_exist") || e.to_string().contains("rdma-core"),
                "{e}"
            ),
        }
    }

    #[test]
    fn a_roce_gid_is_picked_ipv4_mapped_first() {
        let v6 = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];
        // Index 0: RoCE v1; 1: v2 but zero; 2: v2 IPv6; 3: v2 IPv4-mapped.
        let table = [v4, [0; 16], v6, v4];
        let gid_at = |i: i32| table.get(i as usize).copied();
        assert_eq!(pick_roce_gid(4, |i| i > 0, gid_at), Some(3));
        assert_eq!(pick_roce_gid(3, |i| i > 0, gid_at), Some(2), "no IPv4: the first v2");
        assert_eq!(pick_roce_gid(4, |_| false, gid_at), None, "no v2 at all");
        assert!(!is_roce_v2("mlx5_made_up", 0));
    }
}
