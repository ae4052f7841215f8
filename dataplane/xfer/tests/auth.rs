//! Agents serve only authenticated peers: raw clients on real sockets (TCP and the same-host
//! Unix channel) that skip the handshake or fail it get their connection closed with no byte
//! of a region read, written or shared; a client that completes it with the key is served
//! (the control that shows the raw frames are well-formed); an agent given metadata whose key
//! was altered cannot transfer, and says why.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::time::{Duration, Instant};

use kvx_xfer::auth::{NONCE_LEN, PROOF_LEN, Side, proof, verify};
use kvx_xfer::wire::{self, DESC_LEN, FrameKind, HEADER_LEN, Header};
use kvx_xfer::{Agent, AgentConfig, AgentMetadata, Backend, Desc, Op, RegionId, XferError};

const LEN: u64 = 1 << 20;
const IO: Duration = Duration::from_secs(5);
const WAIT: Duration = Duration::from_secs(20);

/// A target agent with one memory region filled with a known pattern.
struct Target {
    agent: Agent,
    region: RegionId,
}

fn target(connect_timeout: Duration) -> Target {
    let mut c = AgentConfig::new("target");
    c.connect_timeout = connect_timeout;
    let agent = Agent::new(c).expect("agent starts");
    let region = agent.alloc_mem(LEN).unwrap();
    let fill: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
    agent.write_local(Desc::new(region, 0, LEN), &fill).unwrap();
    Target { agent, region }
}

impl Target {
    fn md(&self) -> AgentMetadata {
        self.agent.metadata()
    }
    fn bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; LEN as usize];
        self.agent.read_local(Desc::new(self.region, 0, LEN), &mut v).unwrap();
        v
    }
}

/// One frame: header, descriptors, notification area, payload.
fn frame(kind: FrameKind, descs: &[Desc], notif: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut h = Header::new(kind);
    h.ndesc = descs.len() as u32;
    h.notif = notif.len() as u16;
    h.payload = payload.len() as u64;
    h.xfer = 1 << 32 | 7;
    let mut hb = [0u8; HEADER_LEN];
    h.encode(&mut hb);
    let mut v = hb.to_vec();
    for d in descs {
        let mut b = [0u8; DESC_LEN];
        wire::encode_desc(d, &mut b);
        v.extend_from_slice(&b);
    }
    v.extend_from_slice(notif);
    v.extend_from_slice(payload);
    v
}

fn hello(cn: &[u8; NONCE_LEN]) -> Vec<u8> {
    let mut n = cn.to_vec();
    n.extend_from_slice(b"raw");
    frame(FrameKind::Hello, &[], &n, &[])
}

/// Read a HelloAck; check its proof against `key`; return the server nonce.
fn read_hello_ack(s: &mut impl Read, key: &[u8; 32], cn: &[u8; NONCE_LEN]) -> [u8; NONCE_LEN] {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).unwrap();
    let h = Header::decode(&hb).unwrap();
    assert_eq!(h.kind, FrameKind::HelloAck);
    let mut n = vec![0u8; usize::from(h.notif)];
    s.read_exact(&mut n).unwrap();
    let sn: [u8; NONCE_LEN] = n[..NONCE_LEN].try_into().unwrap();
    assert!(verify(key, Side::Target, cn, &sn, &n[NONCE_LEN..NONCE_LEN + PROOF_LEN]));
    assert_eq!(&n[NONCE_LEN + PROOF_LEN..], b"target");
    sn
}

/// Everything the peer sends until it closes the connection (a reset counts as closed).
fn read_until_closed(s: &mut impl Read) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1 << 16];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("connection left open: {e} (after {} bytes)", got.len()),
        }
    }
}

fn tcp(t: &Target) -> TcpStream {
    let s = TcpStream::connect(t.md().tcp.unwrap()).unwrap();
    s.set_read_timeout(Some(IO)).unwrap();
    s
}

/// The requests a raw client tries after whatever opening a test gives it.
fn read_req(t: &Target) -> Vec<u8> {
    frame(FrameKind::ReadReq, &[Desc::new(t.region, 0, 4096)], &[], &[])
}

fn write_req(t: &Target) -> Vec<u8> {
    frame(FrameKind::WriteReq, &[Desc::new(t.region, 0, 4096)], &[], &[0x55; 4096])
}

/// Send `opening` then `req` on a fresh TCP connection (a handshake the opening starts is
/// answered first); return what the target sent after the HelloAck before closing.
fn tcp_attempt(t: &Target, opening: Opening, req: &[u8]) -> Vec<u8> {
    let mut s = tcp(t);
    let key = t.md().key;
    let cn = [0x11u8; NONCE_LEN];
    match opening {
        Opening::None => {}
        Opening::AuthFirst => {
            s.write_all(&frame(FrameKind::Auth, &[], &[0u8; PROOF_LEN], &[])).unwrap();
        }
        Opening::WrongProof | Opening::Key => {
            s.write_all(&hello(&cn)).unwrap();
            let sn = read_hello_ack(&mut s, &key, &cn);
            let mut p = proof(&key, Side::Initiator, &cn, &sn);
            if opening == Opening::WrongProof {
                p[PROOF_LEN - 1] ^= 1;
            }
            s.write_all(&frame(FrameKind::Auth, &[], &p, &[])).unwrap();
        }
    }
    // The target may close before it read everything: a failed write is expected then.
    let _ = s.write_all(req);
    if opening == Opening::Key {
        // Served: read one reply, then hang up ourselves.
        let mut hb = [0u8; HEADER_LEN];
        s.read_exact(&mut hb).unwrap();
        let h = Header::decode(&hb).unwrap();
        let mut rest = vec![0u8; h.payload as usize];
        s.read_exact(&mut rest).unwrap();
        let mut v = hb.to_vec();
        v.extend_from_slice(&rest);
        return v;
    }
    read_until_closed(&mut s)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// Requests straight away.
    None,
    /// Auth before Hello.
    AuthFirst,
    /// Hello, then an Auth whose proof has one bit flipped.
    WrongProof,
    /// The full handshake with the right key (control).
    Key,
}

#[test]
fn tcp_raw_client_with_the_key_is_served() {
    let t = target(IO);
    let got = tcp_attempt(&t, Opening::Key, &read_req(&t));
    let h = Header::decode(&got[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!((h.kind, h.status, h.payload), (FrameKind::ReadData, 0, 4096));
    assert_eq!(got[HEADER_LEN..], t.bytes()[..4096]);
    let got = tcp_attempt(&t, Opening::Key, &write_req(&t));
    let h = Header::decode(&got[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!((h.kind, h.status), (FrameKind::WriteAck, 0));
    assert_eq!(t.bytes()[..4096], [0x55; 4096]);
}

#[test]
fn tcp_read_without_authentication_returns_nothing() {
    let t = target(IO);
    for opening in [Opening::None, Opening::AuthFirst, Opening::WrongProof] {
        let got = tcp_attempt(&t, opening, &read_req(&t));
        assert!(got.is_empty(), "{opening:?}: {} bytes came back", got.len());
    }
}

#[test]
fn tcp_write_without_authentication_changes_nothing() {
    let t = target(IO);
    let before = t.bytes();
    for opening in [Opening::None, Opening::AuthFirst, Opening::WrongProof] {
        let got = tcp_attempt(&t, opening, &write_req(&t));
        assert!(got.is_empty(), "{opening:?}: the target answered");
        assert!(t.bytes() == before, "{opening:?}: the region changed");
    }
    // The agent still serves peers that hold its metadata.
    let a = Agent::new(AgentConfig { same_host: false, ..AgentConfig::new("init") }).unwrap();
    let local = a.alloc_mem(LEN).unwrap();
    let r = a.add_remote(&t.md()).unwrap();
    a.xfer(Op::Read, r, &[Desc::new(local, 0, LEN)], &[Desc::new(t.region, 0, LEN)], b"")
        .unwrap()
        .wait(WAIT)
        .unwrap();
    let mut got = vec![0u8; LEN as usize];
    a.read_local(Desc::new(local, 0, LEN), &mut got).unwrap();
    assert!(got == before);
}

#[test]
fn tcp_silent_connection_closed_after_connect_timeout() {
    let t = target(Duration::from_millis(300));
    let mut s = tcp(&t);
    let start = Instant::now();
    assert!(read_until_closed(&mut s).is_empty());
    assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
    // A half-done handshake is closed as well.
    let mut s = tcp(&t);
    let cn = [4u8; NONCE_LEN];
    s.write_all(&hello(&cn)).unwrap();
    read_hello_ack(&mut s, &t.md().key, &cn);
    assert!(read_until_closed(&mut s).is_empty());
}

/// Receive once from a Unix socket; returns (bytes, fds received). A reset reads as EOF.
// One recvmsg and the walk of the control buffer it filled form one unit.
#[allow(clippy::multiple_unsafe_ops_per_block)]
fn recv_with_fds(s: &UnixStream) -> (usize, usize) {
    let mut buf = [0u8; 4096];
    let mut cbuf = [0u64; 64];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is a valid empty header, filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&cbuf);
    // SAFETY: `msg` points at live buffers of the sizes it declares.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "recvmsg: {e}");
        return (0, 0);
    }
    let mut fds = 0;
    // SAFETY: the CMSG_* accessors walk the control buffer the kernel just filled, bounded
    // by `msg_controllen`; each SCM_RIGHTS entry is an fd now ours, closed by OwnedFd.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    drop(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    fds += 1;
                }
            }
            c = libc::CMSG_NXTHDR(&raw const msg, c);
        }
    }
    (n as usize, fds)
}

/// Send `opening` then a GetFds for the region on the same-host channel; return the bytes
/// and fds that came back after the HelloAck until the target closed (or, with the key, the
/// one reply).
fn unix_get_fds(t: &Target, opening: Opening) -> (usize, usize) {
    let md = t.md();
    let addr = UnixAddr::from_abstract_name(md.unix.as_ref().unwrap().as_bytes()).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(IO)).unwrap();
    let cn = [0x22u8; NONCE_LEN];
    match opening {
        Opening::None => {}
        Opening::AuthFirst => {
            s.write_all(&frame(FrameKind::Auth, &[], &[0u8; PROOF_LEN], &[])).unwrap();
        }
        Opening::WrongProof | Opening::Key => {
            s.write_all(&hello(&cn)).unwrap();
            let sn = read_hello_ack(&mut s, &md.key, &cn);
            let mut p = proof(&md.key, Side::Initiator, &cn, &sn);
            if opening == Opening::WrongProof {
                p[0] ^= 0x80;
            }
            s.write_all(&frame(FrameKind::Auth, &[], &p, &[])).unwrap();
        }
    }
    let _ = s.write_all(&frame(FrameKind::GetFds, &[], &[], &t.region.0.to_le_bytes()));
    if opening == Opening::Key {
        return recv_with_fds(&s);
    }
    let (mut bytes, mut fds) = (0, 0);
    loop {
        let (n, f) = recv_with_fds(&s);
        if n == 0 {
            return (bytes, fds);
        }
        bytes += n;
        fds += f;
    }
}

#[test]
fn unix_get_fds_needs_authentication() {
    let t = target(IO);
    let (bytes, fds) = unix_get_fds(&t, Opening::Key);
    assert_eq!((bytes, fds), (HEADER_LEN + 32, 1), "control: the key gets the fd");
    for opening in [Opening::None, Opening::AuthFirst, Opening::WrongProof] {
        assert_eq!(unix_get_fds(&t, opening), (0, 0), "{opening:?}");
    }
}

#[test]
fn unix_notification_without_authentication_is_dropped() {
    let t = target(IO);
    let addr = UnixAddr::from_abstract_name(t.md().unix.unwrap().as_bytes()).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(IO)).unwrap();
    s.write_all(&frame(FrameKind::Notif, &[], b"forged", &[])).unwrap();
    assert!(read_until_closed(&mut s).is_empty());
    assert!(t.agent.wait_notif(Duration::from_millis(300)).is_none());
}

#[test]
fn altered_key_cannot_transfer() {
    let t = target(Duration::from_secs(2));
    let before = t.bytes();
    let mut md = t.md();
    md.key[13] ^= 0x04;
    // Same host: add_remote authenticates the Unix channel and refuses.
    let a = Agent::new(AgentConfig::new("init")).unwrap();
    let local = a.alloc_mem(LEN).unwrap();
    let start = Instant::now();
    let e = a.add_remote(&md).unwrap_err();
    assert!(matches!(&e, XferError::Auth { peer, .. } if peer == "target"), "{e}");
    assert!(e.to_string().contains("does not hold the key"), "{e}");
    // Over TCP: the first transfer connects and refuses, well within the connect timeout.
    let mut c = AgentConfig::new("init-tcp");
    c.same_host = false;
    c.connect_timeout = Duration::from_secs(2);
    let b = Agent::new(c).unwrap();
    let blocal = b.alloc_mem(LEN).unwrap();
    let r = b.add_remote(&md).unwrap();
    for op in [Op::Write, Op::Read] {
        let e = b
            .xfer(op, r, &[Desc::new(blocal, 0, 4096)], &[Desc::new(t.region, 0, 4096)], b"")
            .unwrap_err();
        assert!(matches!(e, XferError::Auth { .. }), "{op:?}: {e}");
    }
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    assert!(t.bytes() == before);
    // The unaltered metadata works on both channels.
    let r = a.add_remote(&t.md()).unwrap();
    let p = a.prep(r, &[Desc::new(local, 0, 4096)], &[Desc::new(t.region, 0, 4096)], None).unwrap();
    assert_eq!(p.backend(), Backend::Shm);
    a.post(Op::Read, &p, b"").unwrap().wait(WAIT).unwrap();
    let r = b.add_remote(&t.md()).unwrap();
    let p =
        b.prep(r, &[Desc::new(blocal, 0, 4096)], &[Desc::new(t.region, 0, 4096)], None).unwrap();
    assert_eq!(p.backend(), Backend::Tcp);
    b.post(Op::Read, &p, b"").unwrap().wait(WAIT).unwrap();
    let mut got = vec![0u8; 4096];
    b.read_local(Desc::new(blocal, 0, 4096), &mut got).unwrap();
    assert_eq!(got, before[..4096]);
}
