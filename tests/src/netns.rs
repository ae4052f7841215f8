//! Test hosts: network namespaces joined by veth pairs on a bridge, created by the test and
//! removed when dropped (needs root and iproute2). The test process reaches every host
//! through a veth of its own on the same bridge.

use std::process::Command;

/// Hosts `h0..hN` on one /24, each in its own network namespace.
#[derive(Debug)]
pub struct Hosts {
    tag: String,
    names: Vec<String>,
    addrs: Vec<String>,
    /// The lock on its subnet ([`claim_subnet`]), let go when the hosts are gone (after the
    /// namespaces and links, dropped in field order after `Drop::drop`).
    _claim: std::fs::File,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Hosts {
    /// Creates `n` hosts.
    pub fn new(n: usize) -> Hosts {
        // Names from the subnet, which this process holds alone (`claim_subnet`).
        let (net, claim) = claim_subnet(std::process::id());
        let tag = format!("kx{net}");
        let hub = format!("{tag}hub");
        ip(&["netns", "add", &hub]);
        let mut h =
            Hosts { tag: tag.clone(), names: vec![hub.clone()], addrs: Vec::new(), _claim: claim };
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &hub, "link", "set", "br0", "up"]);
        // The test process's own leg.
        let (me, me_br) = (format!("{tag}m"), format!("{tag}mb"));
        ip(&["link", "add", &me, "type", "veth", "peer", "name", &me_br]);
        ip(&["link", "set", &me_br, "netns", &hub]);
        ip(&["-n", &hub, "link", "set", &me_br, "master", "br0", "up"]);
        ip(&["addr", "add", &format!("10.77.{net}.254/24"), "dev", &me]);
        ip(&["link", "set", &me, "up"]);
        for i in 0..n {
            let ns = format!("{tag}h{i}");
            let (v, vb) = (format!("{tag}v{i}"), format!("{tag}b{i}"));
            ip(&["netns", "add", &ns]);
            h.names.push(ns.clone());
            ip(&["link", "add", &v, "type", "veth", "peer", "name", &vb]);
            ip(&["link", "set", &v, "netns", &ns]);
            ip(&["link", "set", &vb, "netns", &hub]);
            ip(&["-n", &hub, "link", "set", &vb, "master", "br0", "up"]);
            let addr = format!("10.77.{net}.{}", i + 1);
            ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", &v]);
            ip(&["-n", &ns, "link", "set", &v, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            h.addrs.push(addr);
        }
        h
    }

    /// Host `i`'s namespace.
    pub fn ns(&self, i: usize) -> &str {
        &self.names[i + 1]
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> &str {
        &self.addrs[i]
    }
}

/// A subnet `10.77.NET.0/24` no other test process holds (the test binaries of a run go
/// two at a time), and the lock that holds it: an exclusive lock on `/tmp/kvx-e2e-net-NET`,
/// tried from `pid % 240` on, which the kernel lets go when the process ends however it
/// ends. What a process that held the subnet before left behind (it crashed past its drops)
/// is removed first.
fn claim_subnet(pid: u32) -> (u32, std::fs::File) {
    for i in 0..240 {
        let net = 10 + (pid + i) % 240;
        let path = std::env::temp_dir().join(format!("kvx-e2e-net-{net}"));
        let Ok(file) = std::fs::OpenOptions::new().create(true).append(true).open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() {
            remove_leftovers(net);
            return (net, file);
        }
    }
    panic!("no free test subnet in 10.77.10-249.0/24");
}

/// Deletes the namespaces and the test-side link of subnet `net`'s earlier holder, if any.
fn remove_leftovers(net: u32) {
    let tag = format!("kx{net}");
    let _ = Command::new("ip")
        .args(["link", "del", &format!("{tag}m")])
        .stderr(std::process::Stdio::null())
        .status();
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let ours = name
            .strip_prefix(&tag)
            .and_then(|r| r.strip_prefix('h'))
            .is_some_and(|r| r == "ub" || (!r.is_empty() && r.bytes().all(|b| b.is_ascii_digit())));
        if ours {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &format!("{}m", self.tag)]).status();
    }
}
