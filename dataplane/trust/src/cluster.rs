//! Cluster membership on the worker planes: every frontend ↔ worker connection proves, before
//! a single frame is read, that both ends belong to the same cluster.
//!
//! * [`ClusterAuth::Mtls`]: mutual TLS. Each side presents a certificate signed by the cluster
//!   CA and checks the other's against it (the dialled side's certificate must also name the
//!   host it was dialled at); the connection stays encrypted.
//! * [`ClusterAuth::Token`]: a shared secret for a single host or a trusted network. Each
//!   side sends a fresh 32-byte nonce, then proves it holds the token with
//!   HMAC-SHA256(token, role ‖ client nonce ‖ server nonce), the dialling side first; the
//!   listening side answers only a correct proof, so a peer without the token learns nothing
//!   and a recorded handshake cannot be replayed. The frames that follow are not encrypted.
//! * [`ClusterAuth::Open`]: no check (loopback set-ups, the default).
//!
//! A handshake that fails, or takes longer than [`HANDSHAKE_TIMEOUT`], ends in a closed
//! connection and an error naming why; nothing of the plane is spoken before it succeeds.

use std::collections::HashSet;
use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hmac::{Hmac, Mac};
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::ServerName;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::TrustError;
use crate::pem::{load_certs, load_key, load_roots, provider};

/// How long a connection may take to prove its membership.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Shortest token accepted (bytes).
pub const MIN_TOKEN_BYTES: usize = 16;

const MAGIC: &[u8; 4] = b"KVXT";
const VERSION: u8 = 1;
const NONCE: usize = 32;
const HELLO: usize = 4 + 1 + NONCE;

/// How the planes of this process authenticate their peers.
#[derive(Clone, Default)]
pub enum ClusterAuth {
    /// No check.
    #[default]
    Open,
    /// A shared token.
    Token(Arc<[u8]>),
    /// Mutual TLS with a cluster CA.
    Mtls(Arc<Mtls>),
}

/// The TLS configurations of mutual-TLS membership.
pub struct Mtls {
    client: TlsConnector,
    server: TlsAcceptor,
}

impl std::fmt::Debug for ClusterAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

impl std::fmt::Debug for Mtls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Mtls")
    }
}

/// Why a peer was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The connection broke or closed during the handshake.
    #[error("connection lost during the cluster handshake: {0}")]
    Io(#[from] io::Error),
    /// The peer did not finish in time.
    #[error("the peer did not complete the cluster handshake within {0:?}")]
    Timeout(Duration),
    /// The peer does not speak the token handshake (no credentials, or another mode).
    #[error(
        "the peer does not speak the cluster handshake (is it started with the same --cluster-* credentials?)"
    )]
    NotCluster,
    /// The peer's proof of the token is wrong.
    #[error("the peer does not hold the cluster token")]
    BadProof,
    /// TLS refused the peer (or the peer refused us).
    #[error("TLS: {0}")]
    Tls(String),
    /// The address dialled cannot be checked against a certificate.
    #[error("cannot check a certificate for {0:?}")]
    BadName(String),
}

impl ClusterAuth {
    /// A token credential (its bytes as given; at least [`MIN_TOKEN_BYTES`]).
    pub fn token(token: &[u8]) -> Result<ClusterAuth, TrustError> {
        if token.len() < MIN_TOKEN_BYTES {
            return Err(TrustError::Config(format!(
                "the cluster token has {} bytes; at least {MIN_TOKEN_BYTES} are needed",
                token.len()
            )));
        }
        Ok(ClusterAuth::Token(Arc::from(token)))
    }

    /// A token read from `path` (surrounding whitespace trimmed).
    pub fn token_file(path: &Path) -> Result<ClusterAuth, TrustError> {
        let raw = std::fs::read(path)
            .map_err(|e| TrustError::Pem { path: path.into(), why: e.to_string() })?;
        let t = raw.trim_ascii();
        Self::token(t).map_err(|e| TrustError::Pem { path: path.into(), why: e.to_string() })
    }

    /// Mutual TLS: `ca` signs every member's certificate; `cert` + `key` are this member's.
    pub fn mtls(ca: &Path, cert: &Path, key: &Path) -> Result<ClusterAuth, TrustError> {
        let roots = load_roots(ca)?;
        let chain = load_certs(cert)?;
        let key_der = load_key(key)?;
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(chain.clone(), key_der.clone_key())?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| TrustError::Config(format!("cluster CA {}: {e}", ca.display())))?;
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key_der)?;
        Ok(ClusterAuth::Mtls(Arc::new(Mtls {
            client: TlsConnector::from(Arc::new(client)),
            server: TlsAcceptor::from(Arc::new(server)),
        })))
    }

    /// "open", "token" or "mutual TLS".
    pub fn describe(&self) -> &'static str {
        match self {
            ClusterAuth::Open => "open",
            ClusterAuth::Token(_) => "token",
            ClusterAuth::Mtls(_) => "mutual TLS",
        }
    }

    /// Whether peers are checked at all.
    pub fn is_open(&self) -> bool {
        matches!(self, ClusterAuth::Open)
    }

    /// The dialling side: proves membership on a connection to `host` (the name or address
    /// dialled, checked against the peer's certificate under mutual TLS).
    pub async fn connect(&self, tcp: TcpStream, host: &str) -> Result<PlaneStream, HandshakeError> {
        let _ = tcp.set_nodelay(true);
        match self {
            ClusterAuth::Open => Ok(PlaneStream::Plain(tcp)),
            ClusterAuth::Token(t) => {
                within(token_handshake(tcp, t, Side::Dialler)).await.map(PlaneStream::Plain)
            }
            ClusterAuth::Mtls(m) => {
                let name = server_name(host)?;
                let tls = within(async {
                    m.client
                        .connect(name, tcp)
                        .await
                        .map_err(|e| HandshakeError::Tls(e.to_string()))
                })
                .await?;
                Ok(PlaneStream::Client(Box::new(tls)))
            }
        }
    }

    /// The listening side: admits a connection only once its peer proved membership.
    pub async fn accept(&self, tcp: TcpStream) -> Result<PlaneStream, HandshakeError> {
        let _ = tcp.set_nodelay(true);
        match self {
            ClusterAuth::Open => Ok(PlaneStream::Plain(tcp)),
            ClusterAuth::Token(t) => {
                within(token_handshake(tcp, t, Side::Listener)).await.map(PlaneStream::Plain)
            }
            ClusterAuth::Mtls(m) => {
                let tls = within(async {
                    m.server.accept(tcp).await.map_err(|e| HandshakeError::Tls(e.to_string()))
                })
                .await?;
                Ok(PlaneStream::Server(Box::new(tls)))
            }
        }
    }
}

/// Remembers the addresses whose connections were refused, so that each is logged once (a
/// peer retrying every 100 ms must not flood the log). Bounded: at most
/// [`RefusalLog::MAX`] addresses are remembered.
#[derive(Debug, Default)]
pub struct RefusalLog {
    seen: Mutex<HashSet<IpAddr>>,
}

impl RefusalLog {
    /// Addresses remembered at most.
    pub const MAX: usize = 4096;

    /// True the first time `ip` is refused (log it then). When [`RefusalLog::MAX`]
    /// addresses are remembered the memory starts over, so that many addresses cannot
    /// silence the log for good.
    pub fn first(&self, ip: IpAddr) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= Self::MAX && !seen.contains(&ip) {
            seen.clear();
        }
        seen.insert(ip)
    }
}

/// The host part of `host` (`HOST:PORT`, `[V6]:PORT` or a bare host) as a TLS server name.
fn server_name(host: &str) -> Result<ServerName<'static>, HandshakeError> {
    let h = match host.rsplit_once(':') {
        Some((h, port)) if port.parse::<u16>().is_ok() => h,
        _ => host,
    };
    let h = h.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(h.to_owned()).map_err(|_| HandshakeError::BadName(host.to_owned()))
}

async fn within<T>(
    f: impl std::future::Future<Output = Result<T, HandshakeError>>,
) -> Result<T, HandshakeError> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, f)
        .await
        .map_err(|_| HandshakeError::Timeout(HANDSHAKE_TIMEOUT))?
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Dialler,
    Listener,
}

fn proof(token: &[u8], role: &[u8], dialler: &[u8; NONCE], listener: &[u8; NONCE]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token).unwrap_or_else(|_| unreachable!());
    mac.update(b"kvx-cluster ");
    mac.update(role);
    mac.update(dialler);
    mac.update(listener);
    mac
}

async fn token_handshake(
    mut tcp: TcpStream,
    token: &[u8],
    side: Side,
) -> Result<TcpStream, HandshakeError> {
    let mine: [u8; NONCE] = rand::random();
    let mut hello = [0u8; HELLO];
    hello[..4].copy_from_slice(MAGIC);
    hello[4] = VERSION;
    hello[5..].copy_from_slice(&mine);
    // The dialler speaks first; the listener answers only a well-formed hello, so that a
    // peer speaking anything else (plane frames, HTTP) gets nothing but a closed connection.
    let mut theirs = [0u8; HELLO];
    if side == Side::Dialler {
        tcp.write_all(&hello).await?;
    }
    tcp.read_exact(&mut theirs).await?;
    if &theirs[..4] != MAGIC || theirs[4] != VERSION {
        return Err(HandshakeError::NotCluster);
    }
    if side == Side::Listener {
        tcp.write_all(&hello).await?;
    }
    let mut other = [0u8; NONCE];
    other.copy_from_slice(&theirs[5..]);
    let (dn, ln) = match side {
        Side::Dialler => (&mine, &other),
        Side::Listener => (&other, &mine),
    };
    let mut got = [0u8; 32];
    match side {
        Side::Dialler => {
            let p = proof(token, b"dialler", dn, ln).finalize().into_bytes();
            tcp.write_all(&p).await?;
            tcp.read_exact(&mut got).await.map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => HandshakeError::BadProof,
                _ => HandshakeError::Io(e),
            })?;
            proof(token, b"listener", dn, ln)
                .verify_slice(&got)
                .map_err(|_| HandshakeError::BadProof)?;
        }
        Side::Listener => {
            tcp.read_exact(&mut got).await?;
            proof(token, b"dialler", dn, ln)
                .verify_slice(&got)
                .map_err(|_| HandshakeError::BadProof)?;
            let p = proof(token, b"listener", dn, ln).finalize().into_bytes();
            tcp.write_all(&p).await?;
        }
    }
    Ok(tcp)
}

/// A plane connection once admitted: plain TCP (open or token) or TLS.
#[derive(Debug)]
pub enum PlaneStream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS, this side dialled.
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// TLS, this side listened.
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl PlaneStream {
    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<std::net::SocketAddr> {
        match self {
            PlaneStream::Plain(s) => s.peer_addr(),
            PlaneStream::Client(s) => s.get_ref().0.peer_addr(),
            PlaneStream::Server(s) => s.get_ref().0.peer_addr(),
        }
    }
}

impl AsyncRead for PlaneStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            PlaneStream::Client(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            PlaneStream::Server(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PlaneStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            PlaneStream::Client(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            PlaneStream::Server(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_flush(cx),
            PlaneStream::Client(s) => Pin::new(s.as_mut()).poll_flush(cx),
            PlaneStream::Server(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            PlaneStream::Client(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            PlaneStream::Server(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            PlaneStream::Client(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            PlaneStream::Server(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            PlaneStream::Plain(s) => s.is_write_vectored(),
            PlaneStream::Client(s) => s.is_write_vectored(),
            PlaneStream::Server(s) => s.is_write_vectored(),
        }
    }
}
