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
        let pid = std::process::id();
        let tag = format!("kx{}", pid % 100_000);
        let net = 10 + pid % 240;
        let hub = format!("{tag}hub");
        ip(&["netns", "add", &hub]);
        let mut h = Hosts { tag: tag.clone(), names: vec![hub.clone()], addrs: Vec::new() };
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

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &format!("{}m", self.tag)]).status();
    }
}
