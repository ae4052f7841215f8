//! An etcd server for tests (Debian's `etcd-server`), on chosen or ephemeral ports, in a
//! network namespace when asked, with its own data directory; killed when dropped, and
//! restartable on the same data (an etcd that goes away and comes back).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running (or stopped) etcd.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    ns: Option<String>,
    /// `http://IP:PORT` clients use.
    pub url: String,
    addr: String,
    args: Vec<String>,
    dir: std::path::PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

impl EtcdServer {
    /// An etcd on 127.0.0.1.
    pub fn start() -> EtcdServer {
        Self::start_in(None, "127.0.0.1")
    }

    /// An etcd on `ip`, in network namespace `ns` when given.
    pub fn start_in(ns: Option<&str>, ip: &str) -> EtcdServer {
        let (client, peer) = (free_port(), free_port());
        let dir =
            std::env::temp_dir().join(format!("kvx-e2e-etcd-{}-{client}", std::process::id()));
        let url = format!("http://{ip}:{client}");
        let peer_url = format!("http://{ip}:{peer}");
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
        let addr = format!("{ip}:{client}");
        let mut s = EtcdServer { child: None, ns: ns.map(str::to_string), url, addr, args, dir };
        s.run();
        s
    }

    /// Starts it (again, on the same data).
    pub fn run(&mut self) {
        let mut cmd = match &self.ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        let child = cmd
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd (Debian package etcd-server) on PATH");
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&self.addr).is_err() {
            assert!(Instant::now() < end, "etcd did not start at {}", self.addr);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills it (SIGKILL).
    pub fn kill(&mut self) {
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
