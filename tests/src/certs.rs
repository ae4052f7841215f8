//! A throw-away PKI for the TLS tests: a CA and certificates it signs, written as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

/// A certificate authority whose files live in a directory.
pub struct Ca {
    dir: PathBuf,
    cert: Certificate,
    key: KeyPair,
    /// The CA certificate (PEM).
    pub ca_pem: PathBuf,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").field("ca_pem", &self.ca_pem).finish()
    }
}

/// A certificate and its key (PEM files).
#[derive(Debug, Clone)]
pub struct Issued {
    /// Certificate chain (leaf only).
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
}

impl Ca {
    /// A new CA named `name`, its certificate written to `DIR/NAME-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Ca {
        std::fs::create_dir_all(dir).expect("certificate directory");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, format!("{name} test CA"));
        let key = KeyPair::generate().expect("CA key");
        let cert = p.self_signed(&key).expect("CA certificate");
        let ca_pem = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca_pem, cert.pem()).expect("writing the CA");
        Ca { dir: dir.to_path_buf(), cert, key, ca_pem }
    }

    /// A certificate for `sans` (host names and IP addresses), good for TLS servers and
    /// clients, written to `DIR/NAME-cert.pem` and `DIR/NAME-key.pem`.
    pub fn issue(&self, name: &str, sans: &[&str]) -> Issued {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(sans).expect("certificate params");
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("key");
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("signing");
        let issued = Issued {
            cert: self.dir.join(format!("{name}-cert.pem")),
            key: self.dir.join(format!("{name}-key.pem")),
        };
        std::fs::write(&issued.cert, cert.pem()).expect("writing a certificate");
        std::fs::write(&issued.key, key.serialize_pem()).expect("writing a key");
        issued
    }
}
