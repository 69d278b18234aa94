//! The out-of-band handshake: how two processes tell each other their queue pairs and memory
//! regions before RDMA starts (what perftest does over its TCP socket), as versioned,
//! length-framed, validated messages ([`crate::wire`]).
//!
//! The client sends its [`Hello`] first; the server reads it, checks it (e.g. that the test
//! parameters in [`Hello::app`] match its own) and answers with its own `Hello` or a
//! [`Channel::reject`] that the client receives as [`Error::Rejected`]. [`Channel::sync`]
//! is a barrier both sides call (e.g. once their QPs are connected, and once the run is done).
//!
//! ```no_run
//! use gdaki::handshake::{Channel, Hello};
//! # fn main() -> gdaki::Result<()> {
//! # let ctx = gdaki::Context::open(gdaki::Provider::Soft)?;
//! # let cq = ctx.create_cq(64)?;
//! # let qp = ctx.create_qp(&cq, Default::default())?;
//! let mut ch = Channel::connect("192.0.2.7:18515".parse().unwrap(), std::time::Duration::from_secs(5))?;
//! ctx.listen(std::net::SocketAddr::new(ch.local_addr().ip(), 0))?;
//! ch.send(&Hello { app: b"size=8".to_vec(), endpoints: vec![qp.endpoint()], regions: vec![] })?;
//! let theirs = ch.receive()?;
//! qp.connect(&theirs.endpoints[0])?;
//! ch.sync(1)?; // both sides connected
//! # Ok(()) }
//! ```
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

pub use gdaki_devx::wire::{Hello, RemoteRegion};

use crate::error::{Error, Result};
use gdaki_devx::wire::{self, Header, Kind, WireError, HEADER_LEN};

fn listener_addr(l: &TcpListener) -> String {
    l.local_addr().map_or_else(|_| "a listener".into(), |a| a.to_string())
}

/// One side of a handshake connection.
#[derive(Debug)]
pub struct Channel {
    stream: TcpStream,
    peer: SocketAddr,
    timeout: Duration,
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

impl Channel {
    /// Connects to a server at `addr` (the client side). A refused connection is an error at
    /// once; every later read waits at most `timeout`.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Channel> {
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| Error::PeerUnreachable {
            what: addr.to_string(),
            why: e.to_string(),
        })?;
        Channel::new(stream, timeout)
    }

    /// Accepts one client on `listener` (the server side); every later read waits at most
    /// `timeout` (the accept itself waits as long as the listener blocks).
    pub fn accept(listener: &TcpListener, timeout: Duration) -> Result<Channel> {
        let (stream, _) = listener.accept().map_err(io("accepting a handshake connection"))?;
        Channel::new(stream, timeout)
    }

    /// Accepts one client on `listener` within `wait` (else [`Error::Timeout`]); every later
    /// read waits at most `timeout`.
    pub fn accept_within(listener: &TcpListener, wait: Duration, timeout: Duration) -> Result<Channel> {
        let deadline = std::time::Instant::now() + wait;
        listener
            .set_nonblocking(true)
            .map_err(io("making a listener non-blocking"))?;
        let accepted = loop {
            match listener.accept() {
                Ok((stream, _)) => break Ok(stream),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if std::time::Instant::now() >= deadline {
                        break Err(Error::Timeout {
                            what: format!("waiting for a client on {}", listener_addr(listener)),
                            after: wait,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(io("accepting a handshake connection")(e)),
            }
        };
        // The listener goes back to blocking whatever happened (its owner may accept again).
        let restored = listener
            .set_nonblocking(false)
            .map_err(io("making a listener blocking"));
        let stream = accepted?;
        restored?;
        stream
            .set_nonblocking(false)
            .map_err(io("making a handshake connection blocking"))?;
        Channel::new(stream, timeout)
    }

    fn new(stream: TcpStream, timeout: Duration) -> Result<Channel> {
        stream.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(io("setting a socket read timeout"))?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(io("setting a socket write timeout"))?;
        let peer = stream.peer_addr().map_err(io("reading the peer's address"))?;
        Ok(Channel { stream, peer, timeout })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// This side's address of the connection (the interface that reaches the peer: a good
    /// address for [`Context::listen`](crate::Context::listen)).
    pub fn local_addr(&self) -> SocketAddr {
        self.stream
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    fn bad(&self, source: WireError) -> Error {
        Error::Protocol {
            peer: self.peer.to_string(),
            source,
        }
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).map_err(io("sending a handshake frame"))
    }

    /// Fills `buf` by `deadline`. The deadline is absolute, not per read, so a peer that sends
    /// a byte at a time cannot hold the channel longer than its timeout.
    fn read_exact(&mut self, buf: &mut [u8], deadline: Instant) -> Result<()> {
        let timeout = || Error::Timeout {
            what: format!("handshake with {}", self.peer),
            after: self.timeout,
        };
        let mut done = 0;
        while done < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timeout());
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(io("setting a socket read timeout"))?;
            match self.stream.read(&mut buf[done..]) {
                Ok(0) => {
                    return Err(Error::PeerUnreachable {
                        what: self.peer.to_string(),
                        why: "it closed the handshake connection".into(),
                    })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Err(timeout())
                }
                Err(e) => {
                    return Err(Error::Io {
                        what: "receiving a handshake frame",
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }

    /// Reads one frame, whole within the channel's timeout; a rejection becomes
    /// [`Error::Rejected`].
    fn frame(&mut self) -> Result<(Header, Vec<u8>)> {
        let deadline = Instant::now() + self.timeout;
        let mut h = [0u8; HEADER_LEN];
        self.read_exact(&mut h, deadline)?;
        let h = Header::parse(&h).map_err(|e| self.bad(e))?;
        if !matches!(h.kind, Kind::Hello | Kind::Reject | Kind::Sync) {
            return Err(self.bad(WireError::Unexpected {
                got: h.kind,
                want: "a handshake frame",
            }));
        }
        let mut p = vec![0u8; h.len as usize];
        self.read_exact(&mut p, deadline)?;
        if h.kind == Kind::Reject {
            let reason = wire::decode_reject(&p).map_err(|e| self.bad(e))?;
            return Err(Error::Rejected {
                peer: self.peer.to_string(),
                reason,
            });
        }
        Ok((h, p))
    }

    /// Sends what this side offers.
    pub fn send(&mut self, hello: &Hello) -> Result<()> {
        let bytes = hello.encode().map_err(|e| self.bad(e))?;
        self.write(&bytes)
    }

    /// Receives what the peer offers, validated. Endpoint addresses with an unspecified IP
    /// (a listener bound to all interfaces) get the IP this connection reaches the peer at.
    pub fn receive(&mut self) -> Result<Hello> {
        let (h, p) = self.frame()?;
        if h.kind != Kind::Hello {
            return Err(self.bad(WireError::Unexpected {
                got: h.kind,
                want: "hello",
            }));
        }
        let mut hello = Hello::decode(&p).map_err(|e| self.bad(e))?;
        for e in &mut hello.endpoints {
            if let Some(a) = e.addr.as_mut().filter(|a| a.ip().is_unspecified()) {
                a.set_ip(self.peer.ip());
            }
        }
        Ok(hello)
    }

    /// Refuses the peer with a reason (cut at [`wire::MAX_REASON_BYTES`]); the peer's next
    /// [`receive`](Self::receive) or [`sync`](Self::sync) fails with it.
    pub fn reject(&mut self, reason: &str) -> Result<()> {
        self.write(&wire::encode_reject(reason))
    }

    /// A barrier: sends `step`, waits for the peer's, and checks both are the same step.
    pub fn sync(&mut self, step: u64) -> Result<()> {
        self.write(&wire::encode_sync(step))?;
        let (h, p) = self.frame()?;
        if h.kind != Kind::Sync {
            return Err(self.bad(WireError::Unexpected {
                got: h.kind,
                want: "sync",
            }));
        }
        let theirs = wire::decode_sync(&p).map_err(|e| self.bad(e))?;
        if theirs != step {
            return Err(self.bad(WireError::Invalid {
                field: "sync step",
                why: format!("peer is at step {theirs}, this side at {step}"),
            }));
        }
        Ok(())
    }
}
