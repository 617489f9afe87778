//! Network namespaces joined by veth pairs to a bridge in a hub namespace: nodes of one subnet,
//! 10.77.0.0/24, seen by nobody else, removed when dropped (a failing test's included). Used by
//! the multi-node tests, the pull benchmark and `feedstore demo --nodes`.
//!
//! Each node's link can be capped like a NIC ([`Lan::cap_link`]): everything the node sends and
//! receives passes one token bucket (`tc tbf` on an IFB device that both directions of the
//! node's bridge port are redirected through), so traffic a node relays counts twice, once in
//! and once out, as it does through a head node that forwards samples.

use std::io;
use std::process::Command;

/// Runs a command, failing with its stderr.
pub fn try_run(cmd: &[&str]) -> io::Result<()> {
    let out = Command::new(cmd[0]).args(&cmd[1..]).output()?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{} failed: {}",
        cmd.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// Runs a command; panics (a test's failure) if it fails.
pub fn run(cmd: &[&str]) {
    try_run(cmd).unwrap_or_else(|e| panic!("{e}"));
}

/// The namespaces of one test or demo run.
pub struct Lan {
    /// The hub namespace holding the bridge.
    pub hub: String,
    /// One namespace per node.
    pub nodes: Vec<String>,
}

impl Lan {
    /// Makes `n` nodes; panics if it cannot (tests).
    pub fn new(tag: &str, n: usize) -> Lan {
        Lan::create(tag, n).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Makes `n` nodes, their names unique to this process and `tag` (needs root, `ip` from
    /// iproute2).
    pub fn create(tag: &str, n: usize) -> io::Result<Lan> {
        let prefix = format!("fs{}{tag}", std::process::id());
        let lan = Lan {
            hub: format!("{prefix}hub"),
            nodes: (0..n).map(|i| format!("{prefix}n{i}")).collect(),
        };
        lan.remove();
        try_run(&["ip", "netns", "add", &lan.hub])?;
        try_run(&["ip", "-n", &lan.hub, "link", "add", "br0", "type", "bridge"])?;
        try_run(&["ip", "-n", &lan.hub, "link", "set", "br0", "up"])?;
        for (i, ns) in lan.nodes.iter().enumerate() {
            let port = format!("p{i}");
            try_run(&["ip", "netns", "add", ns])?;
            try_run(&[
                "ip", "-n", &lan.hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                "netns", ns,
            ])?;
            try_run(&[
                "ip", "-n", &lan.hub, "link", "set", &port, "master", "br0", "up",
            ])?;
            let addr = format!("{}/24", lan.ip(i));
            try_run(&["ip", "-n", ns, "addr", "add", &addr, "dev", "eth0"])?;
            try_run(&["ip", "-n", ns, "link", "set", "eth0", "up"])?;
            try_run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(lan)
    }

    /// Node `i`'s address.
    pub fn ip(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// The command prefix that runs a program in node `i`'s namespace.
    pub fn exec(&self, i: usize) -> [&str; 4] {
        ["ip", "netns", "exec", &self.nodes[i]]
    }

    /// Limits what node `i` sends to `rate` (a `tc` token bucket on its side of the link).
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

    fn hub_tc(&self, args: &[&str]) -> io::Result<()> {
        let mut cmd = vec!["ip", "netns", "exec", &self.hub, "tc"];
        cmd.extend_from_slice(args);
        try_run(&cmd)
    }

    /// Caps node `i`'s link at `bits_per_sec`, what it sends and receives together (see the
    /// module's docs). Calling it again changes the cap.
    pub fn cap_link(&self, i: usize, bits_per_sec: u64) -> io::Result<()> {
        let (port, ifb) = (format!("p{i}"), format!("ifb{i}"));
        let exists = try_run(&["ip", "-n", &self.hub, "link", "show", &ifb]).is_ok();
        if !exists {
            try_run(&["ip", "-n", &self.hub, "link", "add", &ifb, "type", "ifb"])?;
            try_run(&["ip", "-n", &self.hub, "link", "set", &ifb, "up"])?;
            self.hub_tc(&["qdisc", "add", "dev", &port, "clsact"])?;
            for direction in ["ingress", "egress"] {
                self.hub_tc(&[
                    "filter", "add", "dev", &port, direction, "protocol", "all", "u32", "match",
                    "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", &ifb,
                ])?;
            }
        }
        let rate = format!("{bits_per_sec}bit");
        // The bucket holds at least 4 ms of traffic, so the cap is met at high rates too.
        let burst = format!("{}b", (bits_per_sec / 8 / 250).max(64 << 10));
        self.hub_tc(&[
            "qdisc", "replace", "dev", &ifb, "root", "tbf", "rate", &rate, "burst", &burst,
            "latency", "200ms",
        ])
    }

    /// Bytes that crossed node `i`'s link so far, both directions.
    pub fn link_bytes(&self, i: usize) -> io::Result<u64> {
        let mut total = 0;
        for counter in ["rx_bytes", "tx_bytes"] {
            let path = format!("/sys/class/net/p{i}/statistics/{counter}");
            let out = Command::new("ip")
                .args(["netns", "exec", &self.hub, "cat", &path])
                .output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            total += text.trim().parse::<u64>().map_err(|e| {
                io::Error::other(format!("reading {path} in {}: {e} ({text:?})", self.hub))
            })?;
        }
        Ok(total)
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
pub fn enter(name: &str) -> io::Result<()> {
    let ns = std::fs::File::open(format!("/run/netns/{name}"))?;
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)
}
