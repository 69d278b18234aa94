//! The bytes gdaki sends over TCP: one frame format for the out-of-band handshake
//! (`gdaki::handshake`) and for the soft HCA's transport between processes
//! (the soft device's `net` module).
//!
//! Every frame is a 12-byte header followed by its payload, all big-endian:
//!
//! | bytes | field   | value                                              |
//! |-------|---------|----------------------------------------------------|
//! | 0..4  | magic   | `GDKI` (0x4744_4b49)                               |
//! | 4..6  | version | [`VERSION`]; a peer with another version is refused |
//! | 6..8  | kind    | a [`Kind`]                                         |
//! | 8..12 | length  | payload bytes, at most the kind's limit            |
//!
//! Everything here parses untrusted bytes: every decoder checks lengths, counts, ranges and
//! trailing bytes and answers a [`WireError`]; none panics or allocates more than the frame's
//! limit. The fuzz targets in `fuzz/` drive these decoders.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use gdaki_layout::Syndrome;

use gdaki_cuda::IPC_HANDLE_BYTES;

use crate::qp::Endpoint;

/// Frame magic, "GDKI".
pub const MAGIC: u32 = 0x4744_4b49;
/// Protocol version. Bumped on any incompatible change to a payload (2: endpoints carry the
/// port's GID, LID and MTU instead of the soft HCA's identity; 3: endpoints carry the QP's
/// transport secret, which a connect presents; 4: after the accept, the requester offers a
/// shared-memory carrier, which the responder answers; 5: over shared memory, a WRITE from GPU
/// memory may travel as a CUDA IPC reference: [`Kind::GpuOffer`], [`Kind::GpuAnswer`],
/// [`Kind::WriteRef`]; 6: a READ into GPU memory may name the requester's allocation for the
/// responder to write: [`Kind::ReadRef`]; 7: endpoints carry `rd_atomic`; 8: two-sided
/// requests, [`Kind::Send`] and [`Kind::WriteImm`], and the "receiver not ready" answer,
/// [`Kind::RnrNak`]; 9: a SEND from GPU memory may travel as a CUDA IPC reference,
/// [`Kind::SendRef`]; 10: a [`Kind::WriteRef`] may carry a tail, a second referenced range
/// whose bytes follow).
pub const VERSION: u16 = 10;
/// Header size.
pub const HEADER_LEN: usize = 12;
/// Largest application blob in a [`Hello`].
pub const MAX_APP_BYTES: usize = 4096;
/// Most endpoints (and, separately, regions) in a [`Hello`].
pub const MAX_HELLO_ITEMS: usize = 1024;
/// Longest reason in an error frame.
pub const MAX_REASON_BYTES: usize = 1024;
/// Largest RDMA message carried by one transport frame (a WQE's limit).
pub const MAX_MESSAGE: u32 = 1 << 31;

/// Why bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The frame does not start with [`MAGIC`] (not a gdaki peer).
    #[error("not a gdaki peer (magic {0:#010x})")]
    BadMagic(u32),
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {got}, this build speaks {VERSION}")]
    Version {
        /// The peer's version.
        got: u16,
    },
    /// A frame kind this build does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    /// A frame of a kind that is valid but not expected here.
    #[error("unexpected {got:?} frame (expected {want})")]
    Unexpected {
        /// What came.
        got: Kind,
        /// What was expected.
        want: &'static str,
    },
    /// The length field exceeds the kind's limit (or is below its fixed part).
    #[error("{kind:?} frame of {len} bytes (allowed {min}..={max})")]
    Length {
        /// Frame kind.
        kind: Kind,
        /// Length given.
        len: u32,
        /// Smallest allowed.
        min: u32,
        /// Largest allowed.
        max: u32,
    },
    /// The payload ended inside a field.
    #[error("payload ends inside {0}")]
    Truncated(&'static str),
    /// Bytes left after the last field.
    #[error("{0} bytes after the last field")]
    Trailing(usize),
    /// A field holds a value that is not allowed.
    #[error("invalid {field}: {why}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// Why.
        why: String,
    },
}

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Kind {
    /// Handshake: what one side offers ([`Hello`]).
    Hello = 1,
    /// Either protocol: the sender refuses, with a reason (UTF-8 text).
    Reject = 2,
    /// Handshake: a barrier step (u64).
    Sync = 3,
    /// Transport: a requester opens a connection to one of the responder's QPs.
    Connect = 16,
    /// Transport: the responder accepts a [`Kind::Connect`].
    Accept = 17,
    /// Transport, after the accept: the requester offers a shared-memory segment to carry the
    /// connection (its name; empty: none, stay on TCP).
    ShmOffer = 18,
    /// Transport: the responder's answer to a [`Kind::ShmOffer`] (1: mapped, switch; 0: TCP).
    ShmAnswer = 19,
    /// Transport request: RDMA WRITE (head, then the data).
    Write = 20,
    /// Transport request: RDMA READ.
    Read = 21,
    /// Transport request: fetch-and-add.
    FetchAdd = 22,
    /// Transport request: compare-and-swap.
    CompareSwap = 23,
    /// Transport, requester to responder between requests (no sequence number): an allocation
    /// of GPU memory the requester will name in [`Kind::WriteRef`]s and [`Kind::ReadRef`]s once
    /// the responder has mapped it ([`GpuOffer`]).
    GpuOffer = 24,
    /// Transport request: RDMA WRITE whose data the responder reads itself from an offered
    /// allocation ([`Op::WriteRef`]).
    WriteRef = 25,
    /// Transport request: RDMA READ whose data the responder writes itself into an offered
    /// allocation ([`Op::ReadRef`]); answered as a WRITE is, by an [`Kind::Ack`].
    ReadRef = 26,
    /// Transport request: SEND, with or without immediate data (head, then the data); it
    /// takes the responder's next receive.
    Send = 27,
    /// Transport request: RDMA WRITE with immediate data (head, then the data); it takes the
    /// responder's next receive once the data is written.
    WriteImm = 28,
    /// Transport request: SEND whose data the responder reads itself from an offered
    /// allocation ([`Op::SendRef`]); it takes the responder's next receive.
    SendRef = 29,
    /// Transport response: every request up to `seq` succeeded.
    Ack = 30,
    /// Transport response: READ data.
    ReadResp = 31,
    /// Transport response: an atomic's old value.
    AtomicResp = 32,
    /// Transport response: request `seq` failed with a syndrome; nothing after it executes.
    Nak = 33,
    /// Transport, responder to requester between responses: whether an offered allocation
    /// was mapped ([`GpuAnswer`]).
    GpuAnswer = 34,
    /// Transport response: request `seq` found no receive ("receiver not ready"); neither it
    /// nor anything after it executes until the requester sends `seq` again, after the timer
    /// the answer names.
    RnrNak = 35,
}

impl Kind {
    /// The kind with this number.
    pub fn from_raw(v: u16) -> Result<Kind, WireError> {
        Ok(match v {
            1 => Kind::Hello,
            2 => Kind::Reject,
            3 => Kind::Sync,
            16 => Kind::Connect,
            17 => Kind::Accept,
            18 => Kind::ShmOffer,
            19 => Kind::ShmAnswer,
            20 => Kind::Write,
            21 => Kind::Read,
            22 => Kind::FetchAdd,
            23 => Kind::CompareSwap,
            24 => Kind::GpuOffer,
            25 => Kind::WriteRef,
            26 => Kind::ReadRef,
            27 => Kind::Send,
            28 => Kind::WriteImm,
            29 => Kind::SendRef,
            30 => Kind::Ack,
            31 => Kind::ReadResp,
            32 => Kind::AtomicResp,
            33 => Kind::Nak,
            34 => Kind::GpuAnswer,
            35 => Kind::RnrNak,
            _ => return Err(WireError::UnknownKind(v)),
        })
    }

    /// Allowed payload lengths.
    pub fn limits(self) -> (u32, u32) {
        match self {
            // app length + two counts, then the items.
            Kind::Hello => (
                6,
                (6 + MAX_APP_BYTES + MAX_HELLO_ITEMS * (ENDPOINT_MAX + REGION_LEN)) as u32,
            ),
            Kind::Reject => (2, 2 + MAX_REASON_BYTES as u32),
            Kind::Sync => (8, 8),
            Kind::Connect => (CONNECT_LEN as u32, CONNECT_LEN as u32),
            Kind::Accept => (4, 4),
            Kind::ShmOffer => (0, MAX_SHM_NAME as u32),
            Kind::ShmAnswer => (1, 1),
            Kind::Write => (REQ_HEAD as u32, REQ_HEAD as u32 + MAX_MESSAGE),
            Kind::Read => (REQ_HEAD as u32 + 4, REQ_HEAD as u32 + 4),
            Kind::FetchAdd => (REQ_HEAD as u32 + 8, REQ_HEAD as u32 + 8),
            Kind::CompareSwap => (REQ_HEAD as u32 + 16, REQ_HEAD as u32 + 16),
            Kind::GpuOffer => (GPU_OFFER_LEN as u32, GPU_OFFER_LEN as u32),
            Kind::WriteRef => (REQ_HEAD as u32 + 16, REQ_HEAD as u32 + 32),
            Kind::ReadRef => (REQ_HEAD as u32 + 16, REQ_HEAD as u32 + 16),
            Kind::Send => (REQ_HEAD as u32 + 8, REQ_HEAD as u32 + 8 + MAX_MESSAGE),
            Kind::WriteImm => (REQ_HEAD as u32 + 4, REQ_HEAD as u32 + 4 + MAX_MESSAGE),
            Kind::SendRef => (REQ_HEAD as u32 + 24, REQ_HEAD as u32 + 24),
            Kind::Ack => (4, 4),
            Kind::ReadResp => (4, 4 + MAX_MESSAGE),
            Kind::AtomicResp => (12, 12),
            Kind::Nak | Kind::RnrNak => (5, 5),
            Kind::GpuAnswer => (5, 5),
        }
    }
}

/// A checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Payload length, within the kind's limits.
    pub len: u32,
}

impl Header {
    /// A header for `kind` with `len` payload bytes.
    pub fn new(kind: Kind, len: u32) -> Header {
        Header { kind, len }
    }

    /// Encodes the header.
    pub fn encode(self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&VERSION.to_be_bytes());
        b[6..8].copy_from_slice(&(self.kind as u16).to_be_bytes());
        b[8..12].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Decodes and checks a header: magic, version, kind, and the length against the kind.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = u16::from_be_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(WireError::Version { got: version });
        }
        let kind = Kind::from_raw(u16::from_be_bytes([b[6], b[7]]))?;
        let len = u32::from_be_bytes([b[8], b[9], b[10], b[11]]);
        let (min, max) = kind.limits();
        if !(min..=max).contains(&len) {
            return Err(WireError::Length { kind, len, min, max });
        }
        Ok(Header { kind, len })
    }
}

// ------------------------------------------------------------------------------ cursor

/// A bounds-checked big-endian reader over a payload.
struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated(what));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.array(what)?))
    }
    fn end(&self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing(self.b.len()))
        }
    }
}

fn invalid(field: &'static str, why: impl Into<String>) -> WireError {
    WireError::Invalid { field, why: why.into() }
}

/// Checks a 24-bit number (QPNs and PSNs are 24 bits in IB).
fn u24(field: &'static str, v: u32) -> Result<u32, WireError> {
    if v > 0xff_ffff {
        return Err(invalid(field, format!("{v:#x} is wider than 24 bits")));
    }
    Ok(v)
}

fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&Header::new(kind, payload.len() as u32).encode());
    out.extend_from_slice(payload);
    out
}

// ------------------------------------------------------------------------------ handshake

/// A registered region as a peer sees it: where to write or read, and the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteRegion {
    /// Start address.
    pub addr: u64,
    /// Length in bytes (at least 1).
    pub len: u64,
    /// Remote key (never 0).
    pub rkey: u32,
}

impl RemoteRegion {
    /// The device-API address of byte `offset`, if it lies inside.
    pub fn at(&self, offset: u64) -> Option<gdaki_device::Remote> {
        let addr = self.addr.checked_add(offset).filter(|_| offset < self.len)?;
        Some(gdaki_device::Remote { addr, rkey: self.rkey })
    }
}

impl From<RemoteRegion> for gdaki_layout::handle::DevRemote {
    fn from(r: RemoteRegion) -> Self {
        gdaki_layout::handle::DevRemote {
            addr: r.addr,
            len: r.len,
            rkey: r.rkey,
            reserved: 0,
        }
    }
}

impl From<gdaki_layout::handle::DevRemote> for RemoteRegion {
    fn from(r: gdaki_layout::handle::DevRemote) -> Self {
        RemoteRegion {
            addr: r.addr,
            len: r.len,
            rkey: r.rkey,
        }
    }
}

/// What one side of a handshake offers: its queue pairs' endpoints, its regions, and an
/// application blob both sides agree on (e.g. test parameters that must match).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hello {
    /// Application data, at most [`MAX_APP_BYTES`].
    pub app: Vec<u8>,
    /// Queue pairs to connect to, at most [`MAX_HELLO_ITEMS`].
    pub endpoints: Vec<Endpoint>,
    /// Regions the peer may access, at most [`MAX_HELLO_ITEMS`].
    pub regions: Vec<RemoteRegion>,
}

const ENDPOINT_MAX: usize = 16 + 2 + 4 + 4 + 2 + 8 + 1 + 1 + 16 + 2;
const REGION_LEN: usize = 8 + 8 + 4;

impl Hello {
    /// The whole frame, or why these values cannot be sent.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        if self.app.len() > MAX_APP_BYTES {
            return Err(invalid(
                "app data",
                format!("{} bytes (at most {MAX_APP_BYTES})", self.app.len()),
            ));
        }
        for (what, n) in [
            ("endpoint count", self.endpoints.len()),
            ("region count", self.regions.len()),
        ] {
            if n > MAX_HELLO_ITEMS {
                return Err(invalid(what, format!("{n} (at most {MAX_HELLO_ITEMS})")));
            }
        }
        let mut p = Vec::new();
        p.extend_from_slice(&(self.app.len() as u16).to_be_bytes());
        p.extend_from_slice(&self.app);
        p.extend_from_slice(&(self.endpoints.len() as u16).to_be_bytes());
        for e in &self.endpoints {
            put_endpoint(&mut p, e)?;
        }
        p.extend_from_slice(&(self.regions.len() as u16).to_be_bytes());
        for r in &self.regions {
            check_region(r)?;
            p.extend_from_slice(&r.addr.to_be_bytes());
            p.extend_from_slice(&r.len.to_be_bytes());
            p.extend_from_slice(&r.rkey.to_be_bytes());
        }
        Ok(frame(Kind::Hello, &p))
    }

    /// Decodes and validates a [`Kind::Hello`] payload.
    pub fn decode(payload: &[u8]) -> Result<Hello, WireError> {
        let mut c = Cursor { b: payload };
        let app_len = c.u16("app data length")? as usize;
        if app_len > MAX_APP_BYTES {
            return Err(invalid(
                "app data length",
                format!("{app_len} (at most {MAX_APP_BYTES})"),
            ));
        }
        let app = c.take(app_len, "app data")?.to_vec();
        let n = count(&mut c, "endpoint count")?;
        let mut endpoints = Vec::with_capacity(n);
        for _ in 0..n {
            endpoints.push(read_endpoint(&mut c)?);
        }
        let n = count(&mut c, "region count")?;
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            let r = RemoteRegion {
                addr: c.u64("region address")?,
                len: c.u64("region length")?,
                rkey: c.u32("region key")?,
            };
            check_region(&r)?;
            regions.push(r);
        }
        c.end()?;
        Ok(Hello {
            app,
            endpoints,
            regions,
        })
    }
}

/// Appends an endpoint's bytes (checked) to `p`: at most [`ENDPOINT_MAX`] bytes.
fn put_endpoint(p: &mut Vec<u8>, e: &Endpoint) -> Result<(), WireError> {
    check_endpoint(e)?;
    p.extend_from_slice(&e.gid);
    p.extend_from_slice(&e.lid.to_be_bytes());
    p.extend_from_slice(&e.qpn.to_be_bytes());
    p.extend_from_slice(&e.psn.to_be_bytes());
    p.extend_from_slice(&e.mtu.to_be_bytes());
    p.extend_from_slice(&e.secret.to_be_bytes());
    p.push(e.rd_atomic);
    match e.addr {
        None => p.push(0),
        Some(SocketAddr::V4(a)) => {
            p.push(4);
            p.extend_from_slice(&a.ip().octets());
            p.extend_from_slice(&a.port().to_be_bytes());
        }
        Some(SocketAddr::V6(a)) => {
            p.push(6);
            p.extend_from_slice(&a.ip().octets());
            p.extend_from_slice(&a.port().to_be_bytes());
        }
    }
    Ok(())
}

/// Reads and checks one endpoint written by [`put_endpoint`].
fn read_endpoint(c: &mut Cursor<'_>) -> Result<Endpoint, WireError> {
    let gid = c.array::<16>("endpoint GID")?;
    let lid = c.u16("endpoint LID")?;
    let qpn = c.u32("endpoint QPN")?;
    let psn = c.u32("endpoint PSN")?;
    let mtu = c.u16("endpoint MTU")?;
    let secret = c.u64("endpoint secret")?;
    let rd_atomic = c.u8("endpoint READ/atomic responder resources")?;
    let addr = match c.u8("endpoint address family")? {
        0 => None,
        4 => {
            let ip = Ipv4Addr::from(c.array::<4>("IPv4 address")?);
            Some(SocketAddr::new(IpAddr::V4(ip), c.u16("port")?))
        }
        6 => {
            let ip = Ipv6Addr::from(c.array::<16>("IPv6 address")?);
            Some(SocketAddr::new(IpAddr::V6(ip), c.u16("port")?))
        }
        f => return Err(invalid("endpoint address family", format!("{f} (expected 0, 4 or 6)"))),
    };
    let e = Endpoint {
        gid,
        lid,
        qpn,
        psn,
        mtu,
        secret,
        rd_atomic,
        addr,
    };
    check_endpoint(&e)?;
    Ok(e)
}

/// The largest log2 of outstanding RDMA READs and atomics a QP context holds
/// (`log_sra_max` / `log_rra_max` are 3 bits).
pub const MAX_RD_ATOMIC: u8 = 7;

/// Size of an endpoint blob ([`encode_endpoint`]): fixed, so that applications can exchange
/// endpoints through their own bootstrap (an MPI all-gather, a key-value store) as plain bytes.
pub const ENDPOINT_BLOB_LEN: usize = 64;
const _: () = assert!(8 + ENDPOINT_MAX <= ENDPOINT_BLOB_LEN);

/// An endpoint as a fixed-size blob: [`MAGIC`], [`VERSION`], the endpoint's length (u16), its
/// bytes as in a [`Hello`], then zeros up to [`ENDPOINT_BLOB_LEN`].
pub fn encode_endpoint(e: &Endpoint) -> Result<[u8; ENDPOINT_BLOB_LEN], WireError> {
    let mut p = Vec::with_capacity(ENDPOINT_MAX);
    put_endpoint(&mut p, e)?;
    let mut blob = [0u8; ENDPOINT_BLOB_LEN];
    blob[0..4].copy_from_slice(&MAGIC.to_be_bytes());
    blob[4..6].copy_from_slice(&VERSION.to_be_bytes());
    blob[6..8].copy_from_slice(&(p.len() as u16).to_be_bytes());
    blob[8..8 + p.len()].copy_from_slice(&p);
    Ok(blob)
}

/// Decodes and checks an endpoint blob from [`encode_endpoint`] (untrusted bytes: a wrong
/// magic, version, length or non-zero padding is refused).
pub fn decode_endpoint(blob: &[u8]) -> Result<Endpoint, WireError> {
    if blob.len() != ENDPOINT_BLOB_LEN {
        return Err(invalid(
            "endpoint blob",
            format!("{} bytes (expected {ENDPOINT_BLOB_LEN})", blob.len()),
        ));
    }
    let mut c = Cursor { b: blob };
    let magic = c.u32("endpoint blob magic")?;
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = c.u16("endpoint blob version")?;
    if version != VERSION {
        return Err(WireError::Version { got: version });
    }
    let len = c.u16("endpoint blob length")? as usize;
    if len > ENDPOINT_MAX {
        return Err(invalid(
            "endpoint blob length",
            format!("{len} (at most {ENDPOINT_MAX})"),
        ));
    }
    let mut body = Cursor {
        b: c.take(len, "endpoint")?,
    };
    let e = read_endpoint(&mut body)?;
    body.end()?;
    if c.b.iter().any(|&b| b != 0) {
        return Err(invalid("endpoint blob padding", "not zero"));
    }
    Ok(e)
}

fn count(c: &mut Cursor<'_>, what: &'static str) -> Result<usize, WireError> {
    let n = c.u16(what)? as usize;
    if n > MAX_HELLO_ITEMS {
        return Err(invalid(what, format!("{n} (at most {MAX_HELLO_ITEMS})")));
    }
    Ok(n)
}

fn check_endpoint(e: &Endpoint) -> Result<(), WireError> {
    u24("endpoint QPN", e.qpn)?;
    u24("endpoint PSN", e.psn)?;
    if gdaki_layout::prm::command::mtu_code(e.mtu as u32).is_none() {
        return Err(invalid(
            "endpoint MTU",
            format!("{} (expected 256, 512, 1024, 2048 or 4096)", e.mtu),
        ));
    }
    if e.rd_atomic > MAX_RD_ATOMIC {
        return Err(invalid(
            "endpoint READ/atomic responder resources",
            format!(
                "log2 {} (at most {MAX_RD_ATOMIC}: qpc.log_rra_max is 3 bits)",
                e.rd_atomic
            ),
        ));
    }
    if let Some(a) = e.addr {
        if a.port() == 0 {
            return Err(invalid("endpoint address", "port 0"));
        }
        if a.ip().is_multicast() {
            return Err(invalid(
                "endpoint address",
                format!("{} is a multicast address", a.ip()),
            ));
        }
    }
    Ok(())
}

fn check_region(r: &RemoteRegion) -> Result<(), WireError> {
    if r.len == 0 {
        return Err(invalid("region length", "0"));
    }
    if r.addr.checked_add(r.len).is_none() {
        return Err(invalid("region", format!("{:#x} + {} wraps around", r.addr, r.len)));
    }
    if r.rkey == 0 {
        return Err(invalid("region key", "0 is never a valid key"));
    }
    Ok(())
}

/// A [`Kind::Reject`] frame (the reason is cut at [`MAX_REASON_BYTES`], on a character
/// boundary).
pub fn encode_reject(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut p = Vec::with_capacity(2 + end);
    p.extend_from_slice(&(end as u16).to_be_bytes());
    p.extend_from_slice(&reason.as_bytes()[..end]);
    frame(Kind::Reject, &p)
}

/// Decodes a [`Kind::Reject`] payload.
pub fn decode_reject(payload: &[u8]) -> Result<String, WireError> {
    let mut c = Cursor { b: payload };
    let n = c.u16("reason length")? as usize;
    let text = c.take(n, "reason")?;
    c.end()?;
    let text = std::str::from_utf8(text).map_err(|_| invalid("reason", "not UTF-8"))?;
    Ok(printable(text))
}

/// `text` from a peer as it may be shown to a user: its control characters (terminal escapes,
/// bells, new lines) come out escaped (`\u{1b}`), the rest as it is. Every string a peer sent
/// goes through this before it reaches a terminal or a log.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A [`Kind::Sync`] frame.
pub fn encode_sync(step: u64) -> Vec<u8> {
    frame(Kind::Sync, &step.to_be_bytes())
}

/// Decodes a [`Kind::Sync`] payload.
pub fn decode_sync(payload: &[u8]) -> Result<u64, WireError> {
    let mut c = Cursor { b: payload };
    let v = c.u64("sync step")?;
    c.end()?;
    Ok(v)
}

// ------------------------------------------------------------------------------ transport

/// Payload length of a [`Kind::Connect`] frame.
pub const CONNECT_LEN: usize = 8 + 4 + 4 + 4 + 8;
/// Fixed part of every request: seq, rkey, addr.
pub const REQ_HEAD: usize = 4 + 4 + 8;
/// The longest fixed part of a request or response (what a reader holds before the data that
/// follows it): a [`Kind::WriteRef`]'s with a tail.
pub const MAX_FIXED: usize = REQ_HEAD + 32;

/// A requester's opening of a transport connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connect {
    /// The requester's HCA.
    pub hca: u64,
    /// The requester's QP.
    pub qpn: u32,
    /// The responder's QP it sends to.
    pub target_qpn: u32,
    /// The requester's first PSN (the first request's `seq`).
    pub psn: u32,
    /// The target QP's transport secret, from the endpoint the handshake delivered: only the
    /// side that was handed that endpoint can open this connection.
    pub secret: u64,
}

impl Connect {
    /// The whole frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(CONNECT_LEN);
        p.extend_from_slice(&self.hca.to_be_bytes());
        p.extend_from_slice(&self.qpn.to_be_bytes());
        p.extend_from_slice(&self.target_qpn.to_be_bytes());
        p.extend_from_slice(&self.psn.to_be_bytes());
        p.extend_from_slice(&self.secret.to_be_bytes());
        frame(Kind::Connect, &p)
    }

    /// Decodes and validates a [`Kind::Connect`] payload.
    pub fn decode(payload: &[u8]) -> Result<Connect, WireError> {
        let mut c = Cursor { b: payload };
        let v = Connect {
            hca: c.u64("HCA")?,
            qpn: u24("QPN", c.u32("QPN")?)?,
            target_qpn: u24("target QPN", c.u32("target QPN")?)?,
            psn: u24("PSN", c.u32("PSN")?)?,
            secret: c.u64("secret")?,
        };
        c.end()?;
        Ok(v)
    }
}

/// An [`Kind::Accept`] frame for `target_qpn`.
pub fn encode_accept(target_qpn: u32) -> [u8; HEADER_LEN + 4] {
    let mut b = [0u8; HEADER_LEN + 4];
    b[..HEADER_LEN].copy_from_slice(&Header::new(Kind::Accept, 4).encode());
    b[HEADER_LEN..].copy_from_slice(&target_qpn.to_be_bytes());
    b
}

/// Decodes an [`Kind::Accept`] payload: the accepted QPN.
pub fn decode_accept(payload: &[u8]) -> Result<u32, WireError> {
    let mut c = Cursor { b: payload };
    let qpn = u24("accepted QPN", c.u32("accepted QPN")?)?;
    c.end()?;
    Ok(qpn)
}

/// Longest shared-memory segment name in a [`Kind::ShmOffer`].
pub const MAX_SHM_NAME: usize = 64;
/// What every offered segment name starts with.
pub const SHM_PREFIX: &str = "gdaki-";

/// A [`Kind::ShmOffer`] frame: the segment's name, or none (the connection stays on TCP).
pub fn encode_shm_offer(name: Option<&str>) -> Vec<u8> {
    frame(Kind::ShmOffer, name.unwrap_or("").as_bytes())
}

/// Decodes a [`Kind::ShmOffer`] payload. A name is a file name under `/dev/shm` that the
/// responder opens, so only [`SHM_PREFIX`] followed by lowercase hex digits and dashes is
/// accepted: no path, no dots, nothing another program's segment is called.
pub fn decode_shm_offer(payload: &[u8]) -> Result<Option<String>, WireError> {
    if payload.is_empty() {
        return Ok(None);
    }
    let bad = |why: &str| invalid("shared-memory segment name", why);
    let name = std::str::from_utf8(payload).map_err(|_| bad("not UTF-8"))?;
    let Some(rest) = name.strip_prefix(SHM_PREFIX) else {
        return Err(bad(&format!("does not start with {SHM_PREFIX}")));
    };
    if rest.is_empty() || !rest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f' | b'-')) {
        return Err(bad("holds more than lowercase hex digits and dashes"));
    }
    Ok(Some(name.to_owned()))
}

/// A [`Kind::ShmAnswer`] frame: whether the responder mapped the offered segment.
pub fn encode_shm_answer(mapped: bool) -> [u8; HEADER_LEN + 1] {
    let mut b = [0u8; HEADER_LEN + 1];
    b[..HEADER_LEN].copy_from_slice(&Header::new(Kind::ShmAnswer, 1).encode());
    b[HEADER_LEN] = mapped as u8;
    b
}

/// Decodes a [`Kind::ShmAnswer`] payload.
pub fn decode_shm_answer(payload: &[u8]) -> Result<bool, WireError> {
    let mut c = Cursor { b: payload };
    let v = c.take(1, "shared-memory answer")?[0];
    c.end()?;
    match v {
        0 | 1 => Ok(v == 1),
        _ => Err(invalid("shared-memory answer", "neither 0 nor 1")),
    }
}

/// Payload bytes of a [`Kind::GpuOffer`]: id, size, GPU UUID, IPC handle.
const GPU_OFFER_LEN: usize = 4 + 8 + 16 + IPC_HANDLE_BYTES;

/// An allocation of the requester's GPU memory that the responder may map (CUDA IPC) and then
/// read WRITE data from ([`Op::WriteRef`]). Offers on a connection are numbered from 0, in
/// order; the responder answers each with a [`GpuAnswer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuOffer {
    /// The allocation's number on this connection.
    pub id: u32,
    /// Its size as the requester sees it (the responder trusts only its own mapping's).
    pub size: u64,
    /// The GPU it lives on (`cuDeviceGetUuid`).
    pub gpu: [u8; 16],
    /// The driver's IPC handle.
    pub handle: [u8; IPC_HANDLE_BYTES],
}

impl GpuOffer {
    /// The whole frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(GPU_OFFER_LEN);
        p.extend_from_slice(&self.id.to_be_bytes());
        p.extend_from_slice(&self.size.to_be_bytes());
        p.extend_from_slice(&self.gpu);
        p.extend_from_slice(&self.handle);
        frame(Kind::GpuOffer, &p)
    }

    /// Decodes a [`Kind::GpuOffer`] payload.
    pub fn decode(payload: &[u8]) -> Result<GpuOffer, WireError> {
        let mut c = Cursor { b: payload };
        let o = GpuOffer {
            id: c.u32("allocation")?,
            size: c.u64("allocation size")?,
            gpu: c.array("GPU UUID")?,
            handle: c.array("IPC handle")?,
        };
        c.end()?;
        Ok(o)
    }
}

/// The responder's answer to a [`GpuOffer`]: whether it mapped the allocation (then the
/// requester may name it in [`Op::WriteRef`]s; otherwise it keeps sending those bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuAnswer {
    /// The offer's id.
    pub id: u32,
    /// Mapped.
    pub mapped: bool,
}

impl GpuAnswer {
    /// The whole frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = self.id.to_be_bytes().to_vec();
        p.push(self.mapped as u8);
        frame(Kind::GpuAnswer, &p)
    }

    /// Decodes a [`Kind::GpuAnswer`] payload.
    pub fn decode(payload: &[u8]) -> Result<GpuAnswer, WireError> {
        let mut c = Cursor { b: payload };
        let id = c.u32("allocation")?;
        let mapped = match c.u8("mapped")? {
            0 => false,
            1 => true,
            _ => return Err(invalid("mapped", "neither 0 nor 1")),
        };
        c.end()?;
        Ok(GpuAnswer { id, mapped })
    }
}

/// Most bytes of an [`Op::WriteRef`]'s tail.
pub const MAX_REF_TAIL: u32 = 256;

/// `len` bytes at `offset` of offered allocation `alloc` ([`GpuOffer::id`], accepted): where a
/// referenced request's bytes are, such as an [`Op::WriteRef`]'s tail (1 to [`MAX_REF_TAIL`]
/// bytes written after the reference's own, contiguously, and landed after them: a WRITE whose
/// gather list is a message and its trailer, from two buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reference {
    /// The allocation, as offered and accepted.
    pub alloc: u32,
    /// Where the bytes start in it.
    pub offset: u64,
    /// The bytes.
    pub len: u32,
}

/// Checks the length of an [`Op::WriteRef`]'s tail after a reference of `len` bytes.
fn check_tail(len: u32, tail: u32) -> Result<(), WireError> {
    if tail == 0 || tail > MAX_REF_TAIL || len.checked_add(tail).is_none_or(|n| n > MAX_MESSAGE) {
        return Err(invalid(
            "tail length",
            format!("{tail} (1 to {MAX_REF_TAIL}, with the rest at most {MAX_MESSAGE})"),
        ));
    }
    Ok(())
}

/// What a request asks for (the WRITE data follows the head on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// RDMA WRITE of `len` bytes.
    Write {
        /// Data bytes after the head.
        len: u32,
    },
    /// RDMA WRITE of `len` bytes that the responder reads from offset `offset` of the
    /// requester's allocation `alloc` ([`GpuOffer::id`]), mapped with CUDA IPC.
    WriteRef {
        /// The allocation, as offered and accepted.
        alloc: u32,
        /// Where the data starts in it.
        offset: u64,
        /// Data bytes.
        len: u32,
        /// A second range whose bytes follow these (a gather of two: a message and its
        /// trailer), landed last.
        tail: Option<Reference>,
    },
    /// RDMA READ of `len` bytes.
    Read {
        /// Bytes to read.
        len: u32,
    },
    /// RDMA READ of `len` bytes that the responder writes itself at offset `offset` of the
    /// requester's allocation `alloc` ([`GpuOffer::id`]), mapped with CUDA IPC; acknowledged
    /// once they have landed.
    ReadRef {
        /// The allocation, as offered and accepted.
        alloc: u32,
        /// Where the data goes in it.
        offset: u64,
        /// Bytes to read.
        len: u32,
    },
    /// Fetch-and-add.
    FetchAdd {
        /// Addend.
        add: u64,
    },
    /// Compare-and-swap.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// SEND of `len` bytes (they follow the head), with immediate data when `imm` is set;
    /// the request's address and key are 0.
    Send {
        /// Data bytes after the head.
        len: u32,
        /// The immediate data.
        imm: Option<u32>,
    },
    /// SEND of `len` bytes (with immediate data when `imm` is set) that the responder reads
    /// from offset `offset` of the requester's allocation `alloc` ([`GpuOffer::id`]), mapped
    /// with CUDA IPC; the request's address and key are 0.
    SendRef {
        /// The allocation, as offered and accepted.
        alloc: u32,
        /// Where the data starts in it.
        offset: u64,
        /// Data bytes.
        len: u32,
        /// The immediate data.
        imm: Option<u32>,
    },
    /// RDMA WRITE of `len` bytes with immediate data `imm`.
    WriteImm {
        /// Data bytes after the head.
        len: u32,
        /// The immediate data.
        imm: u32,
    },
}

/// A request without its WRITE data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Sequence number (the requester's PSN, counting requests).
    pub seq: u32,
    /// Remote key.
    pub rkey: u32,
    /// Remote address.
    pub addr: u64,
    /// The operation.
    pub op: Op,
}

impl Request {
    /// The frame's header and fixed part (a WRITE's data is sent after it); a length a peer
    /// would refuse (over [`MAX_MESSAGE`]) is refused here.
    pub fn encode_head(&self) -> Result<Vec<u8>, WireError> {
        let (what, len) = match self.op {
            Op::Write { len } => ("write length", len),
            Op::Read { len } => ("read length", len),
            Op::WriteRef { len, .. } | Op::ReadRef { len, .. } | Op::SendRef { len, .. } => ("referenced length", len),
            Op::FetchAdd { .. } | Op::CompareSwap { .. } => ("atomic", 8),
            Op::Send { len, .. } => ("send length", len),
            Op::WriteImm { len, .. } => ("write length", len),
        };
        message_len(what, len)?;
        let (kind, extra, tail): (Kind, u32, Vec<u8>) = match self.op {
            Op::Write { len } => (Kind::Write, len, Vec::new()),
            Op::WriteRef {
                alloc,
                offset,
                len,
                tail,
            } => {
                let mut t = encode_reference(alloc, offset, len);
                if let Some(tail) = tail {
                    check_tail(len, tail.len)?;
                    t.extend_from_slice(&encode_reference(tail.alloc, tail.offset, tail.len));
                }
                (Kind::WriteRef, 0, t)
            }
            Op::ReadRef { alloc, offset, len } => (Kind::ReadRef, 0, encode_reference(alloc, offset, len)),
            Op::Read { len } => (Kind::Read, 0, len.to_be_bytes().to_vec()),
            Op::FetchAdd { add } => (Kind::FetchAdd, 0, add.to_be_bytes().to_vec()),
            Op::CompareSwap { compare, swap } => {
                let mut t = compare.to_be_bytes().to_vec();
                t.extend_from_slice(&swap.to_be_bytes());
                (Kind::CompareSwap, 0, t)
            }
            Op::Send { len, imm } => (Kind::Send, len, encode_imm(imm).to_vec()),
            Op::WriteImm { len, imm } => (Kind::WriteImm, len, imm.to_be_bytes().to_vec()),
            Op::SendRef {
                alloc,
                offset,
                len,
                imm,
            } => {
                let mut t = encode_reference(alloc, offset, len);
                t.extend_from_slice(&encode_imm(imm));
                (Kind::SendRef, 0, t)
            }
        };
        let len = (REQ_HEAD + tail.len()) as u32 + extra;
        let mut out = Vec::with_capacity(HEADER_LEN + REQ_HEAD + tail.len());
        out.extend_from_slice(&Header::new(kind, len).encode());
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.extend_from_slice(&self.rkey.to_be_bytes());
        out.extend_from_slice(&self.addr.to_be_bytes());
        out.extend_from_slice(&tail);
        Ok(out)
    }

    /// How many payload bytes of a `header.kind` request form its fixed part (a WRITE's data
    /// follows them).
    pub fn fixed_len(header: Header) -> Result<usize, WireError> {
        Ok(REQ_HEAD
            + match header.kind {
                Kind::Write => 0,
                Kind::Read | Kind::WriteImm => 4,
                Kind::Send => 8,
                Kind::FetchAdd => 8,
                Kind::CompareSwap | Kind::ReadRef => 16,
                // With a tail or without: nothing follows the fixed part.
                Kind::WriteRef => match (header.len as usize).saturating_sub(REQ_HEAD) {
                    n @ (16 | 32) => n,
                    n => {
                        return Err(invalid(
                            "referenced write",
                            format!("{n} bytes after the head (16 or 32)"),
                        ))
                    }
                },
                Kind::SendRef => 24,
                k => {
                    return Err(WireError::Unexpected {
                        got: k,
                        want: "a request",
                    })
                }
            })
    }

    /// Decodes a request from its header and fixed part (`fixed.len()` ==
    /// [`Request::fixed_len`]).
    pub fn decode(header: Header, fixed: &[u8]) -> Result<Request, WireError> {
        let n = Self::fixed_len(header)?;
        let mut c = Cursor { b: fixed };
        let seq = c.u32("sequence number")?;
        let rkey = c.u32("rkey")?;
        let addr = c.u64("remote address")?;
        let op = match header.kind {
            Kind::Write => Op::Write {
                len: header.len - n as u32,
            },
            Kind::Read => {
                let len = c.u32("read length")?;
                if len > MAX_MESSAGE {
                    return Err(invalid("read length", format!("{len} (at most {MAX_MESSAGE})")));
                }
                Op::Read { len }
            }
            Kind::FetchAdd => Op::FetchAdd { add: c.u64("addend")? },
            Kind::WriteRef => {
                let (alloc, offset, len) = decode_reference(&mut c, "write length")?;
                let tail = if n == REQ_HEAD + 32 {
                    let (alloc, offset, tail) = decode_reference(&mut c, "tail length")?;
                    check_tail(len, tail)?;
                    Some(Reference {
                        alloc,
                        offset,
                        len: tail,
                    })
                } else {
                    None
                };
                Op::WriteRef {
                    alloc,
                    offset,
                    len,
                    tail,
                }
            }
            Kind::ReadRef => {
                let (alloc, offset, len) = decode_reference(&mut c, "read length")?;
                Op::ReadRef { alloc, offset, len }
            }
            Kind::Send => Op::Send {
                imm: decode_imm(&mut c)?,
                len: header.len - n as u32,
            },
            Kind::SendRef => {
                let (alloc, offset, len) = decode_reference(&mut c, "send length")?;
                Op::SendRef {
                    alloc,
                    offset,
                    len,
                    imm: decode_imm(&mut c)?,
                }
            }
            Kind::WriteImm => Op::WriteImm {
                imm: c.u32("immediate data")?,
                len: header.len - n as u32,
            },
            _ => Op::CompareSwap {
                compare: c.u64("compare value")?,
                swap: c.u64("swap value")?,
            },
        };
        c.end()?;
        Ok(Request { seq, rkey, addr, op })
    }
}

/// A SEND's immediate data on the wire: a flag word (0 or 1), then the value (0 without).
fn encode_imm(imm: Option<u32>) -> [u8; 8] {
    let mut t = [0u8; 8];
    t[..4].copy_from_slice(&(imm.is_some() as u32).to_be_bytes());
    t[4..].copy_from_slice(&imm.unwrap_or(0).to_be_bytes());
    t
}

/// [`encode_imm`]'s reverse; a flag that is neither 0 nor 1 is invalid.
fn decode_imm(c: &mut Cursor<'_>) -> Result<Option<u32>, WireError> {
    let flag = c.u32("immediate flag")?;
    let value = c.u32("immediate data")?;
    match flag {
        0 => Ok(None),
        1 => Ok(Some(value)),
        _ => Err(invalid("immediate flag", "neither 0 nor 1")),
    }
}

/// The fixed part of a reference request after the head: allocation, length, offset.
/// `len` if a message may be that long (at most [`MAX_MESSAGE`]), else the error naming `what`.
fn message_len(what: &'static str, len: u32) -> Result<u32, WireError> {
    if len > MAX_MESSAGE {
        return Err(invalid(what, format!("{len} (at most {MAX_MESSAGE})")));
    }
    Ok(len)
}

fn encode_reference(alloc: u32, offset: u64, len: u32) -> Vec<u8> {
    let mut t = alloc.to_be_bytes().to_vec();
    t.extend_from_slice(&len.to_be_bytes());
    t.extend_from_slice(&offset.to_be_bytes());
    t
}

/// Decodes what [`encode_reference`] wrote, checking the length (`what`) and that the range
/// does not wrap.
fn decode_reference(c: &mut Cursor<'_>, what: &'static str) -> Result<(u32, u64, u32), WireError> {
    let alloc = c.u32("allocation")?;
    let len = c.u32(what)?;
    let offset = c.u64("offset in the allocation")?;
    if len > MAX_MESSAGE {
        return Err(invalid(what, format!("{len} (at most {MAX_MESSAGE})")));
    }
    if offset.checked_add(len as u64).is_none() {
        return Err(invalid(
            "offset in the allocation",
            format!("{offset:#x} + {len} wraps"),
        ));
    }
    Ok((alloc, offset, len))
}

/// A responder's answer (a READ response's data follows its head on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Response {
    /// Every request up to and including `seq` succeeded.
    Ack {
        /// Last request acknowledged.
        seq: u32,
    },
    /// READ data for `seq`: `len` bytes follow.
    ReadResp {
        /// The READ's sequence number.
        seq: u32,
        /// Data bytes.
        len: u32,
    },
    /// An atomic's old value.
    Atomic {
        /// The atomic's sequence number.
        seq: u32,
        /// Value before the operation.
        old: u64,
    },
    /// Request `seq` failed; nothing after it was executed.
    Nak {
        /// The failed request.
        seq: u32,
        /// Why.
        syndrome: Syndrome,
    },
    /// Request `seq` found no receive: it and everything after it were dropped; send them
    /// again from `seq` after the RNR timer `timer` (IB's code, 0 to 31).
    RnrNak {
        /// The request that found no receive.
        seq: u32,
        /// The responder's RNR NAK timer code.
        timer: u8,
    },
}

impl Response {
    /// The frame's header and fixed part (a READ response's data follows); a length a peer
    /// would refuse (over [`MAX_MESSAGE`]) is refused here.
    pub fn encode_head(&self) -> Result<Vec<u8>, WireError> {
        let (kind, len, mut body) = match *self {
            Response::Ack { seq } => (Kind::Ack, 4, seq.to_be_bytes().to_vec()),
            Response::ReadResp { seq, len } => (
                Kind::ReadResp,
                4 + message_len("read response length", len)?,
                seq.to_be_bytes().to_vec(),
            ),
            Response::Atomic { seq, old } => {
                let mut b = seq.to_be_bytes().to_vec();
                b.extend_from_slice(&old.to_be_bytes());
                (Kind::AtomicResp, 12, b)
            }
            Response::Nak { seq, syndrome } => {
                let mut b = seq.to_be_bytes().to_vec();
                b.push(syndrome.raw());
                (Kind::Nak, 5, b)
            }
            Response::RnrNak { seq, timer } => {
                let mut b = seq.to_be_bytes().to_vec();
                b.push(timer & 0x1f);
                (Kind::RnrNak, 5, b)
            }
        };
        let mut out = Header::new(kind, len).encode().to_vec();
        out.append(&mut body);
        Ok(out)
    }

    /// How many payload bytes of a `header.kind` response form its fixed part.
    pub fn fixed_len(header: Header) -> Result<usize, WireError> {
        Ok(match header.kind {
            Kind::Ack | Kind::ReadResp => 4,
            Kind::AtomicResp => 12,
            Kind::Nak | Kind::RnrNak => 5,
            k => {
                return Err(WireError::Unexpected {
                    got: k,
                    want: "a response",
                })
            }
        })
    }

    /// Decodes a response from its header and fixed part.
    pub fn decode(header: Header, fixed: &[u8]) -> Result<Response, WireError> {
        Self::fixed_len(header)?;
        let mut c = Cursor { b: fixed };
        let seq = c.u32("sequence number")?;
        let r = match header.kind {
            Kind::Ack => Response::Ack { seq },
            Kind::ReadResp => Response::ReadResp {
                seq,
                len: header.len - 4,
            },
            Kind::AtomicResp => Response::Atomic {
                seq,
                old: c.u64("old value")?,
            },
            Kind::RnrNak => {
                let timer = c.u8("RNR timer")?;
                if timer > 31 {
                    return Err(invalid("RNR timer", format!("{timer} (at most 31)")));
                }
                Response::RnrNak { seq, timer }
            }
            _ => {
                let syndrome = Syndrome::from_raw(c.u8("syndrome")?);
                if matches!(syndrome, Syndrome::Unknown(_)) {
                    return Err(invalid(
                        "syndrome",
                        format!("{:#04x} is not a known syndrome", syndrome.raw()),
                    ));
                }
                Response::Nak { seq, syndrome }
            }
        };
        c.end()?;
        Ok(r)
    }
}

/// Decodes any complete frame (header and payload in `bytes`), for fuzzing and tests:
/// returns the header once every field of the payload checked out.
pub fn check_frame(bytes: &[u8]) -> Result<Header, WireError> {
    let head: &[u8; HEADER_LEN] = bytes
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(WireError::Truncated("the frame header"))?;
    let h = Header::parse(head)?;
    let payload = &bytes[HEADER_LEN..];
    if payload.len() != h.len as usize {
        return Err(WireError::Invalid {
            field: "frame length",
            why: format!("header says {}, {} bytes follow", h.len, payload.len()),
        });
    }
    match h.kind {
        Kind::Hello => Hello::decode(payload).map(drop)?,
        Kind::Reject => decode_reject(payload).map(drop)?,
        Kind::Sync => decode_sync(payload).map(drop)?,
        Kind::Connect => Connect::decode(payload).map(drop)?,
        Kind::Accept => decode_accept(payload).map(drop)?,
        Kind::ShmOffer => decode_shm_offer(payload).map(drop)?,
        Kind::ShmAnswer => decode_shm_answer(payload).map(drop)?,
        Kind::GpuOffer => GpuOffer::decode(payload).map(drop)?,
        Kind::GpuAnswer => GpuAnswer::decode(payload).map(drop)?,
        Kind::Write
        | Kind::WriteRef
        | Kind::Read
        | Kind::ReadRef
        | Kind::FetchAdd
        | Kind::CompareSwap
        | Kind::Send
        | Kind::SendRef
        | Kind::WriteImm => {
            let n = Request::fixed_len(h)?;
            Request::decode(h, &payload[..n])?;
        }
        Kind::Ack | Kind::ReadResp | Kind::AtomicResp | Kind::Nak | Kind::RnrNak => {
            let n = Response::fixed_len(h)?;
            Response::decode(h, &payload[..n])?;
        }
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lengths past what a peer accepts are refused by the encoders, not wrapped into a
    /// header whose length is wrong (nor a panic in debug builds); the largest one encodes.
    #[test]
    fn encoders_refuse_lengths_a_peer_would_refuse() {
        let req = |op| Request {
            seq: 1,
            rkey: 2,
            addr: 3,
            op,
        };
        for op in [
            Op::Write { len: u32::MAX },
            Op::Write { len: MAX_MESSAGE + 1 },
            Op::Read { len: MAX_MESSAGE + 1 },
            Op::WriteRef {
                alloc: 1,
                offset: 0,
                len: MAX_MESSAGE + 1,
                tail: None,
            },
            Op::ReadRef {
                alloc: 1,
                offset: 0,
                len: u32::MAX,
            },
        ] {
            let err = req(op).encode_head().unwrap_err();
            assert!(err.to_string().contains("2147483648"), "{op:?}: {err}");
        }
        for len in [u32::MAX, MAX_MESSAGE + 1] {
            let err = Response::ReadResp { seq: 1, len }.encode_head().unwrap_err();
            assert!(err.to_string().contains("2147483648"), "{err}");
        }
        let head = req(Op::Write { len: MAX_MESSAGE }).encode_head().unwrap();
        let h = Header::parse(head[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.len as usize, REQ_HEAD + MAX_MESSAGE as usize);
        let head = Response::ReadResp {
            seq: 1,
            len: MAX_MESSAGE,
        }
        .encode_head()
        .unwrap();
        assert_eq!(
            Header::parse(head[..HEADER_LEN].try_into().unwrap()).unwrap().len,
            4 + MAX_MESSAGE
        );
    }

    /// Public fields hold anything: an offset that overflows the address is outside, not a
    /// panic (it was one in debug builds).
    #[test]
    fn remote_region_at_never_overflows() {
        let r = RemoteRegion {
            addr: u64::MAX - 4,
            len: 64,
            rkey: 7,
        };
        assert_eq!(r.at(3).map(|x| x.addr), Some(u64::MAX - 1));
        assert_eq!(r.at(5), None);
        assert_eq!(r.at(63), None);
        assert_eq!(r.at(64), None);
    }

    /// A peer's reason is shown to users: control characters (terminal escapes that could
    /// fake output) come out escaped, the rest as sent.
    #[test]
    fn reject_reasons_come_out_escaped() {
        let frame = encode_reject("no \u{1b}[2J\u{1b}[1;1Hroom\n\tfor \u{7f}you, caf\u{e9}");
        let got = decode_reject(&frame[HEADER_LEN..]).unwrap();
        assert_eq!(got, "no \\u{1b}[2J\\u{1b}[1;1Hroom\\n\\tfor \\u{7f}you, caf\u{e9}");
        assert!(!got.chars().any(char::is_control), "{got:?}");
    }

    fn sample() -> Hello {
        Hello {
            app: b"size=8 iters=1000".to_vec(),
            endpoints: vec![
                Endpoint {
                    gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 1],
                    lid: 0,
                    qpn: 0x1234,
                    psn: 7,
                    mtu: 4096,
                    secret: 0x0123_4567_89ab_cdef,
                    rd_atomic: 0,
                    addr: Some("10.0.0.2:18515".parse().unwrap()),
                },
                Endpoint {
                    gid: [3; 16],
                    lid: 0xc001,
                    qpn: 0xff_ffff,
                    psn: 0,
                    mtu: 256,
                    secret: u64::MAX,
                    rd_atomic: 0,
                    addr: Some("[fe80::1]:9".parse().unwrap()),
                },
                Endpoint {
                    gid: [0; 16],
                    lid: 1,
                    qpn: 1,
                    psn: 1,
                    mtu: 1024,
                    secret: 0,
                    rd_atomic: 0,
                    addr: None,
                },
            ],
            regions: vec![RemoteRegion {
                addr: 0x7f00_0000_0000,
                len: 1 << 20,
                rkey: 0x55aa,
            }],
        }
    }

    #[test]
    fn hello_round_trips() {
        let h = sample();
        let bytes = h.encode().unwrap();
        assert_eq!(check_frame(&bytes).unwrap().kind, Kind::Hello);
        assert_eq!(Hello::decode(&bytes[HEADER_LEN..]).unwrap(), h);
    }

    #[test]
    fn endpoint_blobs_round_trip_and_refuse_tampering() {
        for e in sample().endpoints {
            let blob = encode_endpoint(&e).unwrap();
            assert_eq!(decode_endpoint(&blob).unwrap(), e);
            assert!(matches!(decode_endpoint(&blob[..63]), Err(WireError::Invalid { .. })));
            let mut bad = blob;
            bad[0] ^= 1;
            assert!(matches!(decode_endpoint(&bad), Err(WireError::BadMagic(_))));
            let mut bad = blob;
            bad[5] ^= 1;
            assert!(matches!(decode_endpoint(&bad), Err(WireError::Version { .. })));
            let used = u16::from_be_bytes([blob[6], blob[7]]);
            if 8 + (used as usize) < ENDPOINT_BLOB_LEN {
                let mut bad = blob;
                bad[63] = 1;
                assert!(decode_endpoint(&bad).is_err(), "non-zero padding accepted");
            }
            // A length that cuts the endpoint short, or claims the padding.
            for len in [0u16, 20, used - 1, used + 1, ENDPOINT_MAX as u16 + 1] {
                let mut bad = blob;
                bad[6..8].copy_from_slice(&len.to_be_bytes());
                assert!(decode_endpoint(&bad).is_err(), "length {len} accepted");
            }
        }
        let mut e = sample().endpoints[0];
        e.psn = 1 << 24;
        assert!(encode_endpoint(&e).is_err());
    }

    #[test]
    fn every_truncation_and_extension_is_refused() {
        let bytes = sample().encode().unwrap();
        let payload = &bytes[HEADER_LEN..];
        for n in 0..payload.len() {
            assert!(Hello::decode(&payload[..n]).is_err(), "prefix of {n} bytes accepted");
        }
        let mut longer = payload.to_vec();
        longer.push(0);
        assert_eq!(Hello::decode(&longer), Err(WireError::Trailing(1)));
    }

    #[test]
    fn bad_fields_are_named() {
        let mut h = sample();
        h.endpoints[0].qpn = 1 << 24;
        assert!(matches!(
            h.encode(),
            Err(WireError::Invalid {
                field: "endpoint QPN",
                ..
            })
        ));
        let mut h = sample();
        h.endpoints[2].mtu = 1500;
        assert!(matches!(
            h.encode(),
            Err(WireError::Invalid {
                field: "endpoint MTU",
                ..
            })
        ));
        let mut h = sample();
        h.regions[0].rkey = 0;
        assert!(matches!(
            h.encode(),
            Err(WireError::Invalid {
                field: "region key",
                ..
            })
        ));
        let mut h = sample();
        h.regions[0].addr = u64::MAX;
        assert!(h.encode().is_err());
        let mut h = sample();
        h.endpoints[1].addr = Some("1.2.3.4:0".parse().unwrap());
        assert!(h.encode().is_err());
        // A hostile family byte.
        let mut bytes = sample().encode().unwrap();
        let fam = HEADER_LEN + 2 + sample().app.len() + 2 + 37;
        assert_eq!(bytes[fam], 4);
        bytes[fam] = 5;
        assert!(matches!(
            check_frame(&bytes),
            Err(WireError::Invalid {
                field: "endpoint address family",
                ..
            })
        ));
    }

    #[test]
    fn headers_are_checked() {
        let good = Header::new(Kind::Sync, 8).encode();
        assert_eq!(Header::parse(&good).unwrap(), Header::new(Kind::Sync, 8));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Header::parse(&b), Err(WireError::BadMagic(_))));
        let mut b = good;
        b[5] = VERSION as u8 + 1;
        assert_eq!(Header::parse(&b), Err(WireError::Version { got: VERSION + 1 }));
        let mut b = good;
        b[7] = 99;
        assert_eq!(Header::parse(&b), Err(WireError::UnknownKind(99)));
        let b = Header::new(Kind::Sync, 9).encode();
        assert!(matches!(Header::parse(&b), Err(WireError::Length { .. })));
        let b = Header::new(Kind::Hello, u32::MAX).encode();
        assert!(matches!(Header::parse(&b), Err(WireError::Length { .. })));
    }

    /// Every request's and response's fixed part fits a reader's [`MAX_FIXED`] bytes.
    #[test]
    fn fixed_parts_fit_max_fixed() {
        for k in 0..=u16::MAX {
            let Ok(kind) = Kind::from_raw(k) else { continue };
            // At the shortest and the longest payload: a fixed part may grow with it.
            let (shortest, longest) = kind.limits();
            for h in [Header::new(kind, shortest), Header::new(kind, longest)] {
                for n in [Request::fixed_len(h), Response::fixed_len(h)].into_iter().flatten() {
                    assert!(n <= MAX_FIXED, "{kind:?}: {n} bytes fixed");
                }
            }
        }
    }

    #[test]
    fn transport_frames_round_trip() {
        for op in [
            Op::Write { len: 5 },
            Op::Read { len: 1 << 20 },
            Op::FetchAdd { add: 3 },
            Op::CompareSwap { compare: 1, swap: 2 },
            Op::WriteRef {
                alloc: 3,
                offset: 0x1234_5678_9abc,
                len: MAX_MESSAGE,
                tail: None,
            },
            Op::WriteRef {
                alloc: 3,
                offset: 0x1000,
                len: 65536,
                tail: Some(Reference {
                    alloc: 7,
                    offset: 0x20_0000,
                    len: MAX_REF_TAIL,
                }),
            },
            Op::ReadRef {
                alloc: 4,
                offset: 0x9abc,
                len: 1,
            },
            Op::Send { len: 44, imm: None },
            Op::Send {
                len: 0,
                imm: Some(0xdead_beef),
            },
            Op::WriteImm { len: 7, imm: 0 },
            Op::SendRef {
                alloc: 5,
                offset: 0x42,
                len: 9000,
                imm: Some(7),
            },
            Op::SendRef {
                alloc: 0,
                offset: 0,
                len: 1,
                imm: None,
            },
        ] {
            let r = Request {
                seq: 9,
                rkey: 0xabc,
                addr: 0x1000,
                op,
            };
            let mut bytes = r.encode_head().unwrap();
            if let Op::Write { len } | Op::Send { len, .. } | Op::WriteImm { len, .. } = op {
                bytes.extend(std::iter::repeat_n(0xee, len as usize));
            }
            let h = check_frame(&bytes).unwrap();
            let n = Request::fixed_len(h).unwrap();
            assert_eq!(Request::decode(h, &bytes[HEADER_LEN..HEADER_LEN + n]).unwrap(), r);
        }
        for resp in [
            Response::Ack { seq: 1 },
            Response::ReadResp { seq: 2, len: 0 },
            Response::Atomic { seq: 3, old: u64::MAX },
            Response::Nak {
                seq: 4,
                syndrome: Syndrome::RemoteAccess,
            },
            Response::RnrNak { seq: 5, timer: 31 },
        ] {
            let bytes = resp.encode_head().unwrap();
            let h = check_frame(&bytes).unwrap();
            assert_eq!(Response::decode(h, &bytes[HEADER_LEN..]).unwrap(), resp);
        }
        let mut nak = Response::Nak {
            seq: 4,
            syndrome: Syndrome::RemoteAccess,
        }
        .encode_head()
        .unwrap();
        *nak.last_mut().unwrap() = 0xee;
        assert!(check_frame(&nak).is_err());
        // An RNR timer past the table, a SEND's immediate flag neither 0 nor 1.
        let mut rnr = Response::RnrNak { seq: 5, timer: 1 }.encode_head().unwrap();
        *rnr.last_mut().unwrap() = 32;
        assert!(check_frame(&rnr).is_err());
        let mut send = Request {
            seq: 1,
            rkey: 0,
            addr: 0,
            op: Op::Send { len: 0, imm: None },
        }
        .encode_head()
        .unwrap();
        send[HEADER_LEN + REQ_HEAD + 3] = 2;
        assert!(check_frame(&send).is_err());
        let c = Connect {
            hca: 1,
            qpn: 2,
            target_qpn: 3,
            psn: 4,
            secret: 0xfeed_f00d_dead_beef,
        };
        assert_eq!(Connect::decode(&c.encode()[HEADER_LEN..]).unwrap(), c);
        for name in [None, Some("gdaki-0123abcd-42-ff")] {
            let f = encode_shm_offer(name);
            assert_eq!(check_frame(&f).unwrap().kind, Kind::ShmOffer);
            assert_eq!(decode_shm_offer(&f[HEADER_LEN..]).unwrap().as_deref(), name);
        }
        for bad in [
            "gdaki-../../etc/passwd",
            "gdaki-",
            "other-12",
            "gdaki-ABC",
            "gdaki-1/2",
            "gdaki-1.2",
        ] {
            assert!(decode_shm_offer(bad.as_bytes()).is_err(), "{bad}");
        }
        assert!(check_frame(&frame(Kind::ShmOffer, &[b'a'; MAX_SHM_NAME + 1])).is_err());
        for mapped in [false, true] {
            assert_eq!(decode_shm_answer(&encode_shm_answer(mapped)[HEADER_LEN..]), Ok(mapped));
        }
        assert!(decode_shm_answer(&[2]).is_err());
        assert_eq!(decode_reject(&encode_reject("nope")[HEADER_LEN..]).unwrap(), "nope");
        let long = "é".repeat(MAX_REASON_BYTES);
        assert!(decode_reject(&encode_reject(&long)[HEADER_LEN..]).unwrap().len() <= MAX_REASON_BYTES);
    }

    /// The CUDA IPC frames: an offer and its answer round-trip; a reference that is too long,
    /// wraps its offset, or is cut short is refused, as is an answer that is neither yes nor no.
    #[test]
    fn gpu_reference_frames_round_trip_and_refuse_bad_fields() {
        let offer = GpuOffer {
            id: 7,
            size: 1 << 30,
            gpu: [0x5a; 16],
            handle: std::array::from_fn(|i| i as u8),
        };
        let f = offer.encode();
        assert_eq!(check_frame(&f).unwrap().kind, Kind::GpuOffer);
        assert_eq!(GpuOffer::decode(&f[HEADER_LEN..]).unwrap(), offer);
        assert!(GpuOffer::decode(&f[HEADER_LEN..f.len() - 1]).is_err());
        assert!(check_frame(&frame(Kind::GpuOffer, &f[HEADER_LEN..f.len() - 1])).is_err());
        for mapped in [false, true] {
            let a = GpuAnswer { id: 9, mapped };
            let f = a.encode();
            assert_eq!(check_frame(&f).unwrap().kind, Kind::GpuAnswer);
            assert_eq!(GpuAnswer::decode(&f[HEADER_LEN..]).unwrap(), a);
        }
        assert!(GpuAnswer::decode(&[0, 0, 0, 9, 2]).is_err());
        for read in [false, true] {
            let reference = |offset: u64, len: u32| {
                let op = if read {
                    Op::ReadRef { alloc: 0, offset, len }
                } else {
                    Op::WriteRef {
                        alloc: 0,
                        offset,
                        len,
                        tail: None,
                    }
                };
                Request {
                    seq: 1,
                    rkey: 2,
                    addr: 3,
                    op,
                }
                .encode_head()
                .unwrap()
            };
            assert!(check_frame(&reference(u64::MAX - 8, 8)).is_ok());
            assert!(check_frame(&reference(u64::MAX - 8, 9)).is_err(), "the offset wraps");
            // The encoder refuses such a length; a peer may still send one.
            let mut long = reference(0, 8);
            long[HEADER_LEN + REQ_HEAD + 4..][..4].copy_from_slice(&(MAX_MESSAGE + 1).to_be_bytes());
            assert!(check_frame(&long).is_err(), "longer than a message");
            let mut short = reference(0, 8);
            short.pop();
            assert!(check_frame(&short).is_err());
        }
        // Neither is a request or a response.
        assert!(Request::fixed_len(Header::new(Kind::GpuOffer, GPU_OFFER_LEN as u32)).is_err());
    }

    /// A referenced WRITE's tail is 1 to `MAX_REF_TAIL` bytes, within a message with the rest,
    /// and its fixed part is 16 or 32 bytes: the encoder refuses others, the decoder too.
    #[test]
    fn a_referenced_writes_tail_is_checked_both_ways() {
        let with = |len: u32, tail: u32| Request {
            seq: 1,
            rkey: 2,
            addr: 3,
            op: Op::WriteRef {
                alloc: 0,
                offset: 0,
                len,
                tail: Some(Reference {
                    alloc: 1,
                    offset: 64,
                    len: tail,
                }),
            },
        };
        for (len, tail) in [(8, 0), (8, MAX_REF_TAIL + 1), (MAX_MESSAGE, 16)] {
            let err = with(len, tail).encode_head().unwrap_err();
            assert!(err.to_string().contains("tail length"), "{len} {tail}: {err}");
        }
        let good = with(8, 16).encode_head().unwrap();
        assert_eq!(good.len(), HEADER_LEN + REQ_HEAD + 32);
        assert!(check_frame(&good).is_ok());
        // A peer may still send a bad one: each is refused.
        let tail_len_at = HEADER_LEN + REQ_HEAD + 16 + 4;
        for bad in [0u32, MAX_REF_TAIL + 1] {
            let mut f = good.clone();
            f[tail_len_at..][..4].copy_from_slice(&bad.to_be_bytes());
            assert!(check_frame(&f).is_err(), "a tail of {bad}");
        }
        // 20 bytes after the head: neither form.
        let mut odd = good[..HEADER_LEN + REQ_HEAD + 20].to_vec();
        odd[..HEADER_LEN].copy_from_slice(&Header::new(Kind::WriteRef, (REQ_HEAD + 20) as u32).encode());
        assert!(check_frame(&odd).is_err());
        assert!(Response::fixed_len(Header::new(Kind::GpuAnswer, 5)).is_err());
    }
}
