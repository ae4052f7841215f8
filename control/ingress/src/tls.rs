//! HTTPS: the server certificate, reloadable while serving ([`Tls::reload`]: new connections
//! get the new certificate, a failed reload keeps the old one), and the listener that hands
//! axum finished TLS streams. Every handshake runs in its own task under a timeout, so a slow
//! or broken client never holds up the others.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;

use crate::error::IngressError;

/// How long a client has to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes under way at most; above, connections wait in the kernel's accept queue.
const MAX_HANDSHAKES: usize = 1024;

struct Inner {
    cert: PathBuf,
    key: PathBuf,
    config: RwLock<Arc<ServerConfig>>,
}

/// A server certificate chain and key read from PEM files. Clones share the certificate, so
/// a reload through one is seen by all.
#[derive(Clone)]
pub struct Tls {
    inner: Arc<Inner>,
    handshake_timeout: Duration,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("cert", &self.inner.cert)
            .field("key", &self.inner.key)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish()
    }
}

impl Tls {
    /// Reads the certificate chain (`cert`, leaf first) and its private key (`key`).
    pub fn load(cert: &Path, key: &Path) -> Result<Tls, IngressError> {
        let config = read(cert, key)?;
        let inner =
            Inner { cert: cert.to_path_buf(), key: key.to_path_buf(), config: RwLock::new(config) };
        Ok(Tls { inner: Arc::new(inner), handshake_timeout: HANDSHAKE_TIMEOUT })
    }

    /// The same certificate with another handshake timeout.
    pub fn with_handshake_timeout(self, timeout: Duration) -> Tls {
        Tls { handshake_timeout: timeout, ..self }
    }

    /// The certificate file.
    pub fn cert_path(&self) -> &Path {
        &self.inner.cert
    }

    /// Reads both files again; connections accepted from now on use what they hold. On an
    /// error the certificate in force stays. Reads files: call it where blocking is fine.
    pub fn reload(&self) -> Result<(), IngressError> {
        let config = read(&self.inner.cert, &self.inner.key)?;
        *self.inner.config.write().unwrap_or_else(|p| p.into_inner()) = config;
        Ok(())
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.inner.config.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

fn read(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, IngressError> {
    kvx_trust::pem::server_config(cert, key).map_err(|why| IngressError::Tls {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        why,
    })
}

/// A TCP listener whose connections come out as TLS streams (TCP_NODELAY set).
pub(crate) struct TlsListener {
    tcp: TcpListener,
    tls: Tls,
    handshakes: JoinSet<Option<(TlsStream<TcpStream>, SocketAddr)>>,
    send_timeout: Duration,
}

impl TlsListener {
    pub(crate) fn new(tcp: TcpListener, tls: Tls, send_timeout: Duration) -> Self {
        TlsListener { tcp, tls, handshakes: JoinSet::new(), send_timeout }
    }

    fn start_handshake(&mut self, tcp: TcpStream, addr: SocketAddr) {
        crate::conn::tune(&tcp, self.send_timeout);
        let acceptor = self.tls.acceptor();
        let timeout = self.tls.handshake_timeout;
        self.handshakes.spawn(async move {
            match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => Some((stream, addr)),
                // A failed or timed-out handshake closes the connection; nobody else waits.
                _ => None,
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    // Cancel-safe (axum drops it at shutdown): both branches are, and a spawned handshake
    // lives in the set until a later call returns it.
    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let room = self.handshakes.len() < MAX_HANDSHAKES;
            tokio::select! {
                Some(done) = self.handshakes.join_next() => {
                    if let Ok(Some(conn)) = done {
                        return conn;
                    }
                }
                r = self.tcp.accept(), if room => match r {
                    Ok((tcp, addr)) => self.start_handshake(tcp, addr),
                    Err(e) => accept_error(e).await,
                },
                else => tokio::task::yield_now().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// As axum does for plain TCP: a connection's own failure is skipped; anything else (out of
/// file descriptors) waits a moment for connections to close.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if !matches!(e.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use axum::Router;
    use axum::routing::get;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::TlsConnector;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};

    use super::*;

    struct Ca {
        cert: rcgen::Certificate,
        key: KeyPair,
    }

    impl Ca {
        fn new() -> Ca {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let key = KeyPair::generate().unwrap();
            Ca { cert: p.self_signed(&key).unwrap(), key }
        }

        /// A leaf for 127.0.0.1 written to `dir/cert.pem`, `dir/key.pem`; its DER.
        fn issue(&self, dir: &Path) -> Vec<u8> {
            let p = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
            let key = KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
            std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
            std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
            cert.der().to_vec()
        }

        fn client(&self) -> TlsConnector {
            let mut roots = RootCertStore::empty();
            roots.add(CertificateDer::from(self.cert.der().to_vec())).unwrap();
            let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
            let cfg = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            TlsConnector::from(Arc::new(cfg))
        }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvx-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A GET over a new TLS connection: the server's leaf certificate and the body.
    async fn get_over_tls(addr: SocketAddr, client: &TlsConnector) -> (Vec<u8>, String) {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::IpAddress(addr.ip().into());
        let mut s = client.connect(name, tcp).await.unwrap();
        let leaf = s.get_ref().1.peer_certificates().unwrap()[0].to_vec();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        (leaf, String::from_utf8_lossy(&out).into_owned())
    }

    async fn serve(tls: Tls) -> SocketAddr {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let app = Router::new().route("/", get(|| async { "hello" }));
        tokio::spawn(
            axum::serve(TlsListener::new(tcp, tls, Duration::from_secs(30)), app).into_future(),
        );
        addr
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_handshake_holds_up_nobody_and_times_out() {
        let dir = temp_dir("stall");
        let ca = Ca::new();
        ca.issue(&dir);
        let tls = Tls::load(&dir.join("cert.pem"), &dir.join("key.pem"))
            .unwrap()
            .with_handshake_timeout(Duration::from_secs(2));
        let addr = serve(tls).await;
        // One client that connects and says nothing, one that sends half a ClientHello.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).await.unwrap();
        let client = ca.client();
        for _ in 0..3 {
            let t = std::time::Instant::now();
            let (_, body) = get_over_tls(addr, &client).await;
            assert!(body.ends_with("hello"), "{body}");
            assert!(t.elapsed() < Duration::from_millis(1500), "{:?}", t.elapsed());
        }
        // Past the timeout both are closed.
        for s in [&mut silent, &mut half] {
            let mut b = [0u8; 1];
            let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await;
            assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
        }
        // Plain HTTP on the TLS port gets no HTTP answer.
        let mut plain = TcpStream::connect(addr).await.unwrap();
        plain.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut out)).await;
        assert!(!out.starts_with(b"HTTP/"), "{:?}", String::from_utf8_lossy(&out));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_changes_the_certificate_of_new_connections() {
        let dir = temp_dir("reload");
        let ca = Ca::new();
        let first = ca.issue(&dir);
        let tls = Tls::load(&dir.join("cert.pem"), &dir.join("key.pem")).unwrap();
        let addr = serve(tls.clone()).await;
        let client = ca.client();
        assert_eq!(get_over_tls(addr, &client).await.0, first);

        let second = ca.issue(&dir);
        assert_ne!(first, second);
        tls.reload().unwrap();
        let (leaf, body) = get_over_tls(addr, &client).await;
        assert_eq!(leaf, second);
        assert!(body.ends_with("hello"));

        // A broken file: the reload fails naming it, the certificate in force stays.
        std::fs::File::create(dir.join("cert.pem")).unwrap().write_all(b"garbage").unwrap();
        let e = tls.reload().unwrap_err().to_string();
        assert!(e.contains("cert.pem"), "{e}");
        assert_eq!(get_over_tls(addr, &client).await.0, second);
        // A key that does not match the certificate is refused too.
        ca.issue(&dir);
        let other = temp_dir("reload-other");
        ca.issue(&other);
        std::fs::copy(other.join("key.pem"), dir.join("key.pem")).unwrap();
        assert!(tls.reload().is_err());
        assert_eq!(get_over_tls(addr, &client).await.0, second);
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&other).unwrap();
    }

    #[test]
    fn startup_errors_name_the_files() {
        let dir = temp_dir("startup");
        let e = Tls::load(&dir.join("nope.pem"), &dir.join("key.pem")).unwrap_err().to_string();
        assert!(e.contains("nope.pem"), "{e}");
        std::fs::write(dir.join("empty.pem"), "").unwrap();
        let e = Tls::load(&dir.join("empty.pem"), &dir.join("key.pem")).unwrap_err().to_string();
        assert!(e.contains("empty.pem"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
