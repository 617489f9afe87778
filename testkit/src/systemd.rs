//! A service manager of a test's own (a user instance of systemd): what runs the daemon's
//! shipped unit in the tests and benchmarks.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

/// A service manager of the test's own: a user instance of systemd, in a mount namespace where
/// `/run` is a fresh tmpfs holding `/run/systemd/system` (systemd's sign that it is the init
/// system), so nothing on the host changes and PID 1 need not be systemd. Dropped, it stops
/// its services and exits.
pub struct ServiceManager {
    child: std::process::Child,
    /// Its `$XDG_RUNTIME_DIR`: where a user unit's `RuntimeDirectory=` lives.
    pub runtime: std::path::PathBuf,
}

impl ServiceManager {
    /// Starts one, with `dir` as its home for configuration (`dir/config`) and runtime
    /// (`dir/runtime`); its log is `dir/systemd.log`.
    pub fn start(dir: &std::path::Path) -> ServiceManager {
        let runtime = dir.join("runtime");
        std::fs::create_dir_all(&runtime).unwrap();
        std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o700)).unwrap();
        let child = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg("mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system && exec /lib/systemd/systemd --user")
            .env("XDG_RUNTIME_DIR", &runtime)
            .env("XDG_CONFIG_HOME", dir.join("config"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("systemd.log")).unwrap())
            .spawn()
            .expect("starting a user instance of systemd");
        let manager = ServiceManager { child, runtime };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !manager.systemctl(&["is-system-running"]).status.success()
            && !manager.runtime.join("systemd/private").exists()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "systemd --user did not come up: {}",
                std::fs::read_to_string(dir.join("systemd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        manager
    }

    /// `systemctl --user` against it.
    pub fn systemctl(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new("systemctl")
            .arg("--user")
            .args(args)
            .env("XDG_RUNTIME_DIR", &self.runtime)
            .output()
            .unwrap()
    }

    /// `systemctl` that must succeed.
    pub fn must(&self, args: &[&str]) {
        let out = self.systemctl(args);
        assert!(
            out.status.success(),
            "systemctl --user {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// One property of a unit.
    pub fn show(&self, unit: &str, property: &str) -> String {
        let out = self.systemctl(&["show", "--value", "-p", property, unit]);
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Waits until the unit's `property` satisfies `ok`.
    pub fn wait(&self, unit: &str, property: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let value = self.show(unit, property);
            if ok(&value) {
                return value;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{unit}'s {property} stayed {value:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServiceManager {
    fn drop(&mut self) {
        let _ = self.systemctl(&["exit"]);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().ok().flatten().is_none() {
            if std::time::Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The shipped unit (`deploy/systemd/feedstored.service`), installed into a [`ServiceManager`]
/// of a test's own as `feedstored.service`, running `feedstored` (the path given) with the
/// settings given as its `feedstore.toml`.
#[derive(Debug)]
pub struct FeedstoredUnit {
    /// The socket it serves (in the manager's runtime directory, as the unit's
    /// `RuntimeDirectory=` makes it).
    pub socket: std::path::PathBuf,
    /// Its log (standard error, appended).
    pub log: std::path::PathBuf,
}

impl FeedstoredUnit {
    /// The unit's name.
    pub const NAME: &str = "feedstored.service";

    /// Installs the unit (not started). `settings` are `feedstore.toml` lines besides the
    /// socket; `service` are lines for its `[Service]` section (`RestartSec=100ms`, ...).
    pub fn install(
        manager: &ServiceManager,
        dir: &std::path::Path,
        feedstored: &str,
        settings: &str,
        service: &str,
    ) -> FeedstoredUnit {
        // Under a user instance, ConfigurationDirectory= and RuntimeDirectory= live in
        // $XDG_CONFIG_HOME and $XDG_RUNTIME_DIR: the unit's /etc/feedstore and /run/feedstore.
        let (etc, run) = (
            dir.join("config/feedstore"),
            manager.runtime.join("feedstore"),
        );
        let units = dir.join("config/systemd/user");
        std::fs::create_dir_all(units.join("feedstored.service.d")).unwrap();
        std::fs::create_dir_all(&etc).unwrap();
        let shipped = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy/systemd/feedstored.service"),
        )
        .unwrap();
        let unit = shipped
            .replace("/usr/local/bin/feedstored", feedstored)
            .replace("/etc/feedstore/", &format!("{}/", etc.display()));
        assert_ne!(unit, shipped);
        std::fs::write(units.join(Self::NAME), unit).unwrap();
        let log = dir.join("feedstored.log");
        std::fs::write(
            units.join("feedstored.service.d/test.conf"),
            format!(
                "[Service]\n\
                 # A user instance of systemd hides its own notify socket from a service in a\n\
                 # mount namespace, and cannot build ProtectHome='s here; the system manager the\n\
                 # unit is written for does both. The rest is the unit as shipped.\n\
                 ProtectSystem=no\nProtectHome=no\nPrivateTmp=no\nProtectKernelModules=no\n\
                 ProtectControlGroups=no\nStandardError=append:{}\n{service}\n",
                log.display()
            ),
        )
        .unwrap();
        let socket = run.join("feedstore.sock");
        std::fs::write(
            etc.join("feedstore.toml"),
            format!("socket = \"{}\"\n{settings}\n", socket.display()),
        )
        .unwrap();
        manager.must(&["daemon-reload"]);
        FeedstoredUnit { socket, log }
    }
}
