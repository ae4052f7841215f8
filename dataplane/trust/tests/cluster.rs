//! Cluster membership over real loopback sockets: the token handshake and mutual TLS admit
//! members, and refuse peers without the credential, with a wrong one, or speaking
//! something else, before anything of theirs is read.

use std::path::Path;

use kvx_trust::{ClusterAuth, HandshakeError};
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A CA in `dir` (`NAME-ca.pem`) and a member certificate for 127.0.0.1 and localhost signed
/// by it (`NAME-cert.pem`, `NAME-key.pem`).
fn pki(dir: &Path, name: &str) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let mut leaf = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    leaf.extended_key_usages =
        vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&key, &ca_cert, &ca_key).unwrap();
    std::fs::write(dir.join(format!("{name}-ca.pem")), ca_cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{name}-cert.pem")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{name}-key.pem")), key.serialize_pem()).unwrap();
}

fn mtls(dir: &Path, ca: &str, member: &str) -> ClusterAuth {
    ClusterAuth::mtls(
        &dir.join(format!("{ca}-ca.pem")),
        &dir.join(format!("{member}-cert.pem")),
        &dir.join(format!("{member}-key.pem")),
    )
    .unwrap()
}

/// Runs one handshake: `server` accepts, `client` dials; both results, and whether a byte
/// written by the client after its handshake reached the server.
async fn pair(
    server: ClusterAuth,
    client: ClusterAuth,
) -> (Result<Vec<u8>, HandshakeError>, Result<(), HandshakeError>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let srv = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let mut s = server.accept(tcp).await?;
        let mut got = vec![0u8; 5];
        s.read_exact(&mut got).await?;
        Ok(got)
    });
    let tcp = TcpStream::connect(&addr).await.unwrap();
    let c = match client.connect(tcp, &addr).await {
        Ok(mut s) => {
            let _ = s.write_all(b"hello").await;
            let _ = s.flush().await;
            // Keep the connection open until the server has read.
            let r = srv.await.unwrap();
            return (r, Ok(()));
        }
        Err(e) => Err(e),
    };
    (srv.await.unwrap(), c)
}

#[tokio::test]
async fn a_shared_token_admits_members_only() {
    let t = ClusterAuth::token(b"0123456789abcdef-cluster").unwrap();
    let (s, c) = pair(t.clone(), t.clone()).await;
    assert_eq!(s.unwrap(), b"hello");
    c.unwrap();

    let wrong = ClusterAuth::token(b"0123456789abcdef-CLUSTER").unwrap();
    let (s, c) = pair(t.clone(), wrong.clone()).await;
    assert!(matches!(s, Err(HandshakeError::BadProof)), "{s:?}");
    assert!(matches!(c, Err(HandshakeError::BadProof)), "{c:?}");

    // A member without credentials speaks the plane at once: refused, nothing read.
    let (s, _) = pair(t.clone(), ClusterAuth::Open).await;
    assert!(s.is_err(), "{s:?}");
    // A member with a token dialling an open listener: the listener reads the hello as plane
    // bytes; the dialler never gets an answer and gives up.
    assert!(ClusterAuth::token(b"short").is_err());
}

#[tokio::test]
async fn a_raw_client_gets_a_closed_connection_and_no_bytes() {
    let t = ClusterAuth::token(b"0123456789abcdef-cluster").unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let srv = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        t.accept(tcp).await.map(|_| ())
    });
    let mut raw = TcpStream::connect(addr).await.unwrap();
    // A plane frame (len, version, kind, JSON) instead of the hello.
    let mut frame = vec![0u8; 0];
    let body = br#"{"worker_id":1,"model":"m","block_size":16}"#;
    frame.extend_from_slice(&((body.len() + 2) as u32).to_le_bytes());
    frame.extend_from_slice(&[1, 1]);
    frame.extend_from_slice(body);
    frame.resize(64, b' ');
    raw.write_all(&frame).await.unwrap();
    assert!(matches!(srv.await.unwrap(), Err(HandshakeError::NotCluster)));
    let mut got = Vec::new();
    let n = raw.read_to_end(&mut got).await.unwrap_or(0);
    assert_eq!(n, 0, "the listener sent {got:?}");
}

#[tokio::test]
async fn mutual_tls_admits_certificates_of_the_cluster_ca_only() {
    let dir = std::env::temp_dir().join(format!("kvx-trust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    pki(&dir, "a");
    pki(&dir, "b");
    let (s, c) = pair(mtls(&dir, "a", "a"), mtls(&dir, "a", "a")).await;
    assert_eq!(s.unwrap(), b"hello");
    c.unwrap();

    // A client whose certificate another CA signed: the server refuses it.
    let (s, _) = pair(mtls(&dir, "a", "a"), mtls(&dir, "a", "b")).await;
    assert!(matches!(s, Err(HandshakeError::Tls(_))), "{s:?}");
    // A server whose certificate another CA signed: the client refuses it.
    let (_, c) = pair(mtls(&dir, "a", "b"), mtls(&dir, "a", "a")).await;
    assert!(matches!(c, Err(HandshakeError::Tls(_))), "{c:?}");
    // A client with no credentials at all gets nothing.
    let (s, _) = pair(mtls(&dir, "a", "a"), ClusterAuth::Open).await;
    assert!(s.is_err(), "{s:?}");
    // Missing files are named.
    let e =
        ClusterAuth::mtls(&dir.join("none.pem"), &dir.join("a-cert.pem"), &dir.join("a-key.pem"))
            .unwrap_err();
    assert!(e.to_string().contains("none.pem"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn each_refused_address_is_logged_once() {
    let log = kvx_trust::RefusalLog::default();
    let a: std::net::IpAddr = "10.0.0.1".parse().unwrap();
    let b: std::net::IpAddr = "10.0.0.2".parse().unwrap();
    assert!(log.first(a));
    assert!(!log.first(a));
    assert!(log.first(b));
    for i in 0..kvx_trust::RefusalLog::MAX as u32 {
        let _ = log.first(std::net::IpAddr::from(i.to_be_bytes()));
    }
    // Full: the memory starts over, so a new address is logged, and so is an old one again.
    assert!(log.first("192.168.255.255".parse().unwrap()));
    assert!(log.first(a));
    assert!(!log.first(a));
}
