//! Certificates, keys and trust roots read from PEM files.

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::TrustError;

/// The certificate chain in `path` (leaf first).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TrustError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| TrustError::pem(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TrustError::pem(path, e))?;
    if certs.is_empty() {
        return Err(TrustError::Pem { path: path.into(), why: "no CERTIFICATE block".into() });
    }
    Ok(certs)
}

/// The private key in `path` (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TrustError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TrustError::pem(path, e))
}

/// A root store holding every certificate in `path` (a CA bundle).
pub fn load_roots(path: &Path) -> Result<Arc<RootCertStore>, TrustError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots
            .add(c)
            .map_err(|e| TrustError::Pem { path: path.into(), why: format!("not a CA: {e}") })?;
    }
    Ok(Arc::new(roots))
}

/// The crypto provider every config here is built with (ring).
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server config for `cert` + `key`, asking no client certificate (the HTTP API).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TrustError> {
    let certs = load_certs(cert)?;
    let key = load_key(key)?;
    let cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TrustError::Tls)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(TrustError::Tls)?;
    Ok(Arc::new(cfg))
}
