//! Discovery against a real etcd (Debian's `etcd-server`, started by the test on loopback):
//! records appear and go, a lease that is not kept alive expires, and a watcher and a
//! registrar ride out an etcd that goes away and comes back.

#![allow(clippy::disallowed_methods)] // the test finds `etcd` on PATH and waits on the clock

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_discovery::{Etcd, EtcdConfig, FleetChange, Registrar, WorkerRecord, watch_fleet};
use kvx_proto::plane::WorkerRole;
use tokio::sync::mpsc::Receiver;

/// An etcd on ephemeral loopback ports with its own data directory.
struct EtcdServer {
    child: Option<Child>,
    url: String,
    args: Vec<String>,
    dir: std::path::PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

impl EtcdServer {
    fn start() -> EtcdServer {
        let (client, peer) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("kvx-etcd-{}-{client}", std::process::id()));
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let args = vec![
            "--data-dir".into(),
            dir.display().to_string(),
            "--listen-client-urls".into(),
            url.clone(),
            "--advertise-client-urls".into(),
            url.clone(),
            "--listen-peer-urls".into(),
            peer_url.clone(),
            "--initial-advertise-peer-urls".into(),
            peer_url.clone(),
            "--initial-cluster".into(),
            format!("default={peer_url}"),
        ];
        let mut s = EtcdServer { child: None, url, args, dir };
        s.run();
        s
    }

    fn run(&mut self) {
        let child = Command::new("etcd")
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd (Debian package etcd-server) on PATH");
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(20);
        let port = self.url.rsplit(':').next().unwrap_or_default().to_string();
        while std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err() {
            assert!(Instant::now() < end, "etcd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cfg(url: &str, ns: &str, ttl: u64) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![url.to_string()],
        namespace: ns.into(),
        ttl: Duration::from_secs(ttl),
        timeout: Duration::from_secs(2),
        credentials: Default::default(),
    }
}

fn record(id: u64) -> WorkerRecord {
    WorkerRecord {
        worker_id: id,
        endpoint: format!("127.0.0.1:{}", 7000 + id),
        role: WorkerRole::Decode,
        model: "m".into(),
        fingerprint: "m.gguf:123".into(),
        block_size: 16,
        kv_blocks: 256,
        kv_agent: vec![1, 2, 3],
    }
}

async fn next(rx: &mut Receiver<FleetChange>, limit: Duration) -> FleetChange {
    tokio::time::timeout(limit, rx.recv()).await.expect("a change in time").expect("open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_appear_and_go_and_an_unkept_lease_expires() {
    let etcd = EtcdServer::start();
    let c = cfg(&etcd.url, "t1", 2);
    let client = Arc::new(Etcd::new(&c.endpoints, c.timeout).expect("client"));
    let mut fleet = watch_fleet(client.clone(), &c);
    let mut reg = Registrar::start(client.clone(), &c, vec![record(1), record(2)]);
    assert!(reg.wait_registered(Duration::from_secs(5)).await);
    let mut up = Vec::new();
    for _ in 0..2 {
        match next(&mut fleet, Duration::from_secs(5)).await {
            FleetChange::Up(r) => up.push(r),
            other => panic!("{other:?}"),
        }
    }
    up.sort_by_key(|r| r.worker_id);
    assert_eq!(up, [record(1), record(2)], "the records, whole");
    // Kept alive past its TTL: still there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(fleet.try_recv().is_err(), "nothing changed while the lease was kept");
    reg.withdraw().await;
    let mut down = Vec::new();
    for _ in 0..2 {
        match next(&mut fleet, Duration::from_secs(5)).await {
            FleetChange::Down(id) => down.push(id),
            other => panic!("{other:?}"),
        }
    }
    down.sort_unstable();
    assert_eq!(down, [1, 2]);
    // A record under a lease nobody keeps alive (a dead worker) expires within its TTL.
    let lease = client.grant(1).await.expect("grant");
    let v = serde_json::to_vec(&record(3)).expect("json");
    client.put(&format!("{}3", c.workers_prefix()), &v, lease).await.expect("put");
    assert_eq!(next(&mut fleet, Duration::from_secs(5)).await, FleetChange::Up(record(3)));
    let t0 = Instant::now();
    assert_eq!(next(&mut fleet, Duration::from_secs(10)).await, FleetChange::Down(3));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_that_goes_away_and_comes_back_changes_nothing_then_catches_up() {
    let mut etcd = EtcdServer::start();
    let c = cfg(&etcd.url, "t2", 3);
    let client = Arc::new(Etcd::new(&c.endpoints, c.timeout).expect("client"));
    let mut fleet = watch_fleet(client.clone(), &c);
    let mut reg = Registrar::start(client.clone(), &c, vec![record(1)]);
    assert!(reg.wait_registered(Duration::from_secs(5)).await);
    assert_eq!(next(&mut fleet, Duration::from_secs(5)).await, FleetChange::Up(record(1)));
    etcd.kill();
    // While it is away the view stands: no worker is dropped.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(fleet.try_recv().is_err(), "a view changed while etcd was away");
    etcd.run();
    // The registrar's lease outlived the outage or it registers again; a worker that joins
    // now is seen.
    let client2 = Arc::new(Etcd::new(&c.endpoints, c.timeout).expect("client"));
    let mut reg2 = Registrar::start(client2, &c, vec![record(2)]);
    assert!(reg2.wait_registered(Duration::from_secs(10)).await);
    let end = Instant::now() + Duration::from_secs(15);
    let mut seen2 = false;
    while !seen2 {
        assert!(Instant::now() < end, "the new worker was not seen");
        if let Ok(Some(ch)) = tokio::time::timeout(Duration::from_millis(200), fleet.recv()).await {
            assert_ne!(ch, FleetChange::Down(1), "worker 1 stayed registered");
            seen2 |= ch == FleetChange::Up(record(2));
        }
    }
    let (_, kvs) = client.range(&c.workers_prefix()).await.expect("range");
    assert_eq!(kvs.len(), 2, "both records are in etcd");
    reg.withdraw().await;
    reg2.withdraw().await;
}
