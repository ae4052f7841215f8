//! TLS to etcd: the client configuration (etcd's CA, and a client certificate when etcd
//! runs with `--client-cert-auth`), a connector that speaks TLS to `https://` endpoints and
//! plain TCP to `http://` ones, and the naming of TLS failures (an untrusted server
//! certificate, a refused or missing client certificate) in words a person can act on.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::AlertDescription;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::DiscoveryError;

/// The TLS client configuration for etcd: `ca` (PEM) verifies etcd's server certificate;
/// `client` (certificate chain, key; PEM) answers etcd's request for a client certificate.
pub(crate) fn client_config(
    ca: &Path,
    client: Option<&(PathBuf, PathBuf)>,
) -> Result<Arc<rustls::ClientConfig>, DiscoveryError> {
    let cfg_err = |what: &str, e: &dyn std::fmt::Display| {
        DiscoveryError::Config(format!("etcd TLS ({what}): {e}"))
    };
    let roots = kvx_trust::pem::load_roots(ca).map_err(|e| cfg_err("--etcd-ca", &e))?;
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| cfg_err("protocol versions", &e))?
    .with_root_certificates(Arc::unwrap_or_clone(roots));
    let cfg = match client {
        Some((cert, key)) => {
            let chain = kvx_trust::pem::load_certs(cert).map_err(|e| cfg_err("--etcd-cert", &e))?;
            let key = kvx_trust::pem::load_key(key).map_err(|e| cfg_err("--etcd-key", &e))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| cfg_err("--etcd-cert/--etcd-key", &e))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(cfg))
}

/// Connects to etcd endpoints: TLS for `https://`, plain TCP for `http://`.
#[derive(Clone)]
pub(crate) struct EtcdConnector {
    http: HttpConnector,
    tls: Option<TlsConnector>,
}

impl std::fmt::Debug for EtcdConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConnector").field("tls", &self.tls.is_some()).finish()
    }
}

impl EtcdConnector {
    /// Over `http` (which must not insist on `http://`), with TLS when `tls` is given.
    pub(crate) fn new(http: HttpConnector, tls: Option<Arc<rustls::ClientConfig>>) -> Self {
        EtcdConnector { http, tls: tls.map(TlsConnector::from) }
    }
}

/// A connection to an etcd endpoint.
#[derive(Debug)]
pub(crate) enum EtcdStream {
    /// `http://`.
    Plain(TcpStream),
    /// `https://`.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connection for EtcdStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for EtcdStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EtcdStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            EtcdStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for EtcdStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            EtcdStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            EtcdStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EtcdStream::Plain(s) => Pin::new(s).poll_flush(cx),
            EtcdStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EtcdStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            EtcdStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

type Connecting = Pin<Box<dyn Future<Output = io::Result<TokioIo<EtcdStream>>> + Send>>;

impl tower_service::Service<Uri> for EtcdConnector {
    type Response = TokioIo<EtcdStream>;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        tower_service::Service::<Uri>::poll_ready(&mut self.http, cx).map_err(io::Error::other)
    }

    fn call(&mut self, uri: Uri) -> Connecting {
        let mut http = self.http.clone();
        let tls = self.tls.clone();
        Box::pin(async move {
            let https = uri.scheme_str() == Some("https");
            let host = uri.host().unwrap_or_default().trim_matches(['[', ']']).to_string();
            let tcp = http.call(uri).await.map_err(io::Error::other)?.into_inner();
            if !https {
                return Ok(TokioIo::new(EtcdStream::Plain(tcp)));
            }
            let Some(tls) = tls else {
                return Err(io::Error::other("an https:// etcd endpoint without --etcd-ca"));
            };
            let name = ServerName::try_from(host)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let stream = tls.connect(name, tcp).await?;
            Ok(TokioIo::new(EtcdStream::Tls(Box::new(stream))))
        })
    }
}

/// The TLS failure somewhere in `e`'s chain of causes, if any.
pub(crate) fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<rustls::Error> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(t.clone());
        }
        // `io::Error::source` skips the error it wraps: look inside.
        cur = match err.downcast_ref::<io::Error>().and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    None
}

/// What a TLS failure with etcd means, for a person; `client_cert`: whether one was given.
pub(crate) fn describe(e: &rustls::Error, client_cert: bool) -> String {
    match e {
        rustls::Error::InvalidCertificate(why) => format!(
            "etcd's server certificate is not trusted ({why:?}): is --etcd-ca the CA that \
             signed it, and does it name the endpoint's host?"
        ),
        rustls::Error::AlertReceived(alert) if !client_cert && refuses_client_cert(*alert) => {
            format!(
                "etcd asks for a client certificate (it answered {alert:?}): give --etcd-cert \
                 and --etcd-key"
            )
        }
        rustls::Error::AlertReceived(alert) if refuses_client_cert(*alert) => format!(
            "etcd refused the client certificate (it answered {alert:?}): is --etcd-cert \
             signed by a CA etcd trusts (its --trusted-ca-file)?"
        ),
        other => format!("TLS with etcd failed: {other}"),
    }
}

fn refuses_client_cert(a: AlertDescription) -> bool {
    matches!(
        a,
        AlertDescription::CertificateRequired
            | AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::AccessDenied
            | AlertDescription::HandshakeFailure
    )
}
