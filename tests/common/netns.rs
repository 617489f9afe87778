//! Network namespaces for multi-node tests and benchmarks: made by the test, joined by veth
//! pairs to a bridge in a hub namespace, and removed when dropped, a failing test's included.

#![allow(dead_code)]

use std::process::Command;

pub fn run(cmd: &[&str]) {
    let out = Command::new(cmd[0]).args(&cmd[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Network namespaces joined by veth pairs to a bridge in a hub namespace: one subnet,
/// 10.77.0.0/24, seen by nobody else. Removed on drop.
pub struct Lan {
    pub hub: String,
    pub nodes: Vec<String>,
}

impl Lan {
    pub fn new(tag: &str, n: usize) -> Lan {
        let prefix = format!("fs{}{tag}", std::process::id());
        let lan = Lan {
            hub: format!("{prefix}hub"),
            nodes: (0..n).map(|i| format!("{prefix}n{i}")).collect(),
        };
        lan.remove();
        run(&["ip", "netns", "add", &lan.hub]);
        run(&["ip", "-n", &lan.hub, "link", "add", "br0", "type", "bridge"]);
        run(&["ip", "-n", &lan.hub, "link", "set", "br0", "up"]);
        for (i, ns) in lan.nodes.iter().enumerate() {
            let port = format!("p{i}");
            run(&["ip", "netns", "add", ns]);
            run(&[
                "ip", "-n", &lan.hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                "netns", ns,
            ]);
            run(&[
                "ip", "-n", &lan.hub, "link", "set", &port, "master", "br0", "up",
            ]);
            run(&[
                "ip",
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", lan.ip(i)),
                "dev",
                "eth0",
            ]);
            run(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        lan
    }

    pub fn ip(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    pub fn exec(&self, i: usize) -> [&str; 4] {
        ["ip", "netns", "exec", &self.nodes[i]]
    }

    /// Limits what node `i` sends to `rate` (a `tc` token bucket).
    pub fn rate_limit(&self, i: usize, rate: &str) {
        run(&[
            "ip",
            "netns",
            "exec",
            &self.nodes[i],
            "tc",
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "64kb",
            "latency",
            "200ms",
        ]);
    }

    fn remove(&self) {
        for ns in self.nodes.iter().chain([&self.hub]) {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Moves the calling thread into namespace `name` (threads it starts afterwards live there too).
pub fn enter(name: &str) {
    let ns = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
}
