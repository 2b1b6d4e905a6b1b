//! Real processes: a `redis-server` on a free loopback port and the
//! `atmost` binary. Both are killed on drop, so a failing test or run leaves
//! nothing behind.

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Ports [`free_port`] has handed out in this process: never handed out
/// twice, so two servers of one test binary never start on one port (the
/// second would fail to bind while the first answered its PING), and a
/// server restarted on its port finds it free of this process's others.
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A free TCP port on 127.0.0.1 (free when asked, and never handed out
/// before by this process; callers retry on a clash with another process).
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind a loopback port")
            .port();
        if HANDED_OUT
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port)
        {
            return port;
        }
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// Whether process `pid` holds the socket listening on `port` (any local
/// address, IPv4 or IPv6), from the kernel's tables: no command of the
/// server's, which a test may have renamed away. `None` only where there is
/// no /proc to tell; a process gone, or no listener of its, is `false`.
fn listener_is(pid: u32, port: u16) -> Option<bool> {
    let v4 = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let v6 = std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    let port = format!(":{port:04X}");
    // sl local_address rem_address st ... inode: a listener is state 0A.
    let listeners: Vec<String> = v4
        .lines()
        .skip(1)
        .chain(v6.lines().skip(1))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = fields.get(1)?;
            (local.ends_with(&port) && fields.get(3) == Some(&"0A"))
                .then(|| fields.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Some(false);
    };
    Some(fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| listeners.iter().any(|l| target.as_os_str() == l.as_str()))
    }))
}

/// A `redis-server` of our own on a loopback port, killed on drop.
pub struct RedisServer {
    child: Option<Tethered>,
    port: u16,
    extra: Vec<String>,
    /// Its working directory, its own: a replica writes the copy it
    /// receives there (`dump.rdb`), and a server loads what it finds there
    /// when it starts, so two servers must never share one. Removed on drop.
    dir: PathBuf,
}

impl RedisServer {
    /// Starts `redis-server` (no persistence) on a free port.
    pub fn start() -> std::io::Result<Self> {
        Self::start_with(&[])
    }

    /// Starts `redis-server` with extra arguments (e.g. `--appendonly yes`)
    /// on a free port, trying a few ports if one is taken meanwhile.
    pub fn start_with(extra: &[&str]) -> std::io::Result<Self> {
        Self::start_on(|_| extra.iter().map(|s| s.to_string()).collect())
    }

    /// Starts `redis-server` with the arguments `extra` gives for the port
    /// chosen (a Cluster node names its bus port and config file by it),
    /// trying a few ports if one is taken meanwhile.
    pub fn start_on(extra: impl Fn(u16) -> Vec<String>) -> std::io::Result<Self> {
        let mut last = None;
        let dir =
            std::env::temp_dir().join(format!("atmost-redis-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir)?;
        for _ in 0..5 {
            let port = free_port();
            let extra = extra(port);
            match spawn_redis(port, &dir, &extra) {
                Ok(child) => {
                    return Ok(Self {
                        child: Some(child),
                        port,
                        extra,
                        dir,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        Err(last.unwrap_or_else(|| std::io::Error::other("redis-server did not start")))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the process (SIGKILL); what it held in memory is gone.
    pub fn kill(&mut self) {
        if let Some(child) = self.child.take() {
            child.kill();
        }
    }

    /// Whether it was started and not killed since (it may have exited).
    pub fn is_running_now(&self) -> bool {
        self.child.is_some()
    }

    /// Whether the process is running (not killed, not exited).
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(Tethered::is_running)
    }

    /// Starts it again on the same port, with the same arguments.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        self.child = Some(spawn_redis(self.port, &self.dir, &self.extra)?);
        Ok(())
    }

    /// Starts it again on the same port with other extra arguments (a
    /// Redis restarted with another configuration).
    pub fn restart_with(&mut self, extra: &[&str]) -> std::io::Result<()> {
        self.extra = extra.iter().map(|s| s.to_string()).collect();
        self.restart()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `redis-server` run under a small shell that SIGKILLs it when its
/// standard input closes: when [`Tethered::kill`] closes it, and when this
/// process ends in any way (a panic, a `static` fixture never dropped, a
/// SIGKILL from a CI timeout), so no test leaves a server behind.
pub struct Tethered {
    shell: Child,
    /// The server's process id, as the shell started it.
    pid: u32,
}

impl Tethered {
    /// Runs `redis-server <args>` tethered to this process.
    pub fn spawn(args: &[String]) -> std::io::Result<Self> {
        let mut shell = Command::new("sh")
            .arg("-c")
            // The shell ends when the server does; the reader, when the
            // input closes (killing the server if it still runs). A
            // background job's input is /dev/null unless redirected, so the
            // reader reads the pipe through fd 3.
            // The server's pid is the shell's first and only line out.
            .arg(concat!(
                r#"exec 3<&0; redis-server "$@" </dev/null >/dev/null & r=$!; "#,
                r#"echo $r; exec 1>/dev/null; "#,
                r#"{ read _ignored <&3; kill -9 $r 2>/dev/null; } & wait $r"#
            ))
            .arg("sh")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut line = String::new();
        let read =
            std::io::BufReader::new(shell.stdout.take().expect("piped")).read_line(&mut line);
        let mut tethered = Self { shell, pid: 0 };
        match read.ok().and_then(|_| line.trim().parse().ok()) {
            Some(pid) => {
                tethered.pid = pid;
                Ok(tethered)
            }
            None => {
                drop(tethered);
                Err(std::io::Error::other("redis-server did not start"))
            }
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// SIGKILLs the server and waits until it is gone.
    pub fn kill(mut self) {
        drop(self.shell.stdin.take());
        let _ = self.shell.wait();
    }

    fn is_running(&mut self) -> bool {
        matches!(self.shell.try_wait(), Ok(None))
    }
}

impl Drop for Tethered {
    fn drop(&mut self) {
        drop(self.shell.stdin.take());
        let _ = self.shell.wait();
    }
}

/// Spawns `redis-server` on `port` and waits until it answers, as itself:
/// another process's server on the port (a port taken since it was found
/// free) is an error, never taken for ours.
fn spawn_redis(port: u16, dir: &Path, extra: &[String]) -> std::io::Result<Tethered> {
    if Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "cannot run redis-server: install it (scripts/test.sh does) \
             or set REDIS_URL to a Redis to use",
        ));
    }
    // A configuration file (a Sentinel's) must come first.
    let (file, extra) = match extra.split_first() {
        Some((first, rest)) if !first.starts_with("--") => (vec![first.clone()], rest),
        _ => (Vec::new(), extra),
    };
    let mut args: Vec<String> = file;
    args.extend(
        [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--dir",
        ]
        .map(String::from),
    );
    args.push(dir.to_string_lossy().into_owned());
    args.extend(extra.iter().cloned());
    let mut child = Tethered::spawn(&args)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if ping(port) {
            match listener_is(child.pid(), port) {
                Some(true) => return Ok(child),
                None if child.is_running() => return Ok(child),
                None | Some(false) => {
                    child.kill();
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::AddrInUse,
                        format!("port {port} is another process's"),
                    ));
                }
            }
        }
        if !child.is_running() {
            return Err(std::io::Error::other(format!(
                "redis-server on port {port} exited"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill();
    Err(std::io::Error::other(format!(
        "redis-server on port {port} did not answer within 10 s"
    )))
}

/// A running `atmost serve`, killed on drop.
pub struct AtmostProcess {
    child: Child,
    addr: SocketAddr,
    /// From its "atmost metrics on ADDR" line (with --metrics-listen).
    metrics_addr: Option<SocketAddr>,
    bin: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Where its stderr (the log) goes; none: this process's stderr.
    log: Option<PathBuf>,
}

impl AtmostProcess {
    /// Starts `<bin> serve --listen 127.0.0.1:0 <args>` and waits for its
    /// "atmost listening on ADDR" line (after "atmost metrics on ADDR"
    /// with --metrics-listen).
    pub fn spawn<S: AsRef<str>>(bin: &Path, args: &[S]) -> std::io::Result<Self> {
        Self::spawn_with_env::<S, &str>(bin, args, &[])
    }

    /// [`spawn`](Self::spawn) with extra environment variables (e.g.
    /// `LD_PRELOAD` and `FAKETIME` for a process whose clock is off), kept
    /// for [`restart`](Self::restart).
    pub fn spawn_with_env<S: AsRef<str>, E: AsRef<str>>(
        bin: &Path,
        args: &[S],
        env: &[(E, E)],
    ) -> std::io::Result<Self> {
        Self::start(bin, args, env, None)
    }

    /// [`spawn_with_env`](Self::spawn_with_env) with its log (stderr)
    /// appended to the file at `log` (a restart appends to it too), for the
    /// test to read.
    pub fn spawn_logged<S: AsRef<str>, E: AsRef<str>>(
        bin: &Path,
        args: &[S],
        env: &[(E, E)],
        log: &Path,
    ) -> std::io::Result<Self> {
        Self::start(bin, args, env, Some(log.to_owned()))
    }

    fn start<S: AsRef<str>, E: AsRef<str>>(
        bin: &Path,
        args: &[S],
        env: &[(E, E)],
        log: Option<PathBuf>,
    ) -> std::io::Result<Self> {
        let args: Vec<String> = args.iter().map(|s| s.as_ref().to_owned()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
            .collect();
        let (child, addr, metrics_addr) =
            spawn_atmost(bin, "127.0.0.1:0", &args, &env, log.as_deref())?;
        Ok(Self {
            child,
            addr,
            metrics_addr,
            bin: bin.to_owned(),
            args,
            env,
            log,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where it serves `GET /metrics`: the address it announced, `None`
    /// without --metrics-listen (ATMOST_METRICS_LISTEN). After a
    /// [`restart`](Self::restart) on `:0`, the new port.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// A client connected to it.
    pub async fn client(&self) -> atmost_client::Client {
        atmost_client::Client::connect(format!("http://{}", self.addr))
            .await
            .expect("connect to atmost")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no drain, no goodbye. Returns how it ended.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// How it exited, if it has.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills it and starts it again on the same address, so clients'
    /// channels reconnect to it.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match spawn_atmost(
                &self.bin,
                &self.addr.to_string(),
                &self.args,
                &self.env,
                self.log.as_deref(),
            ) {
                Ok((child, _, metrics_addr)) => {
                    self.child = child;
                    self.metrics_addr = metrics_addr;
                    return Ok(());
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Sends SIGTERM and waits (at most `within`) for the exit status.
    pub fn terminate(&mut self, within: Duration) -> Option<ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for AtmostProcess {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// Starts it and reads its start-up lines: (the child, the gRPC address,
/// the metrics address if it serves metrics).
fn spawn_atmost(
    bin: &Path,
    listen: &str,
    args: &[String],
    env: &[(String, String)],
    log: Option<&Path>,
) -> std::io::Result<(Child, SocketAddr, Option<SocketAddr>)> {
    let stderr = match log {
        Some(path) => Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
        None => Stdio::inherit(),
    };
    let mut child = Command::new(bin)
        .args(["serve", "--listen", listen])
        .args(args)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()),
        )
        // No audit trail on the test's stderr (a test that reads it asks
        // with --audit-log, or ATMOST_AUDIT_LOG in `env`).
        .env(
            "ATMOST_AUDIT_LOG",
            std::env::var("ATMOST_AUDIT_LOG").unwrap_or_else(|_| "off".into()),
        )
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut stdout = std::io::BufReader::new(stdout);
    let mut line = String::new();
    // "atmost metrics on ADDR" first, with --metrics-listen; the gRPC line
    // is the last at start-up, so nothing is written after the pipe closes.
    stdout.read_line(&mut line)?;
    let mut metrics_addr = None;
    if let Some(metrics) = line.trim().strip_prefix("atmost metrics on ") {
        metrics_addr = metrics.parse().ok();
        if metrics_addr.is_some() {
            line.clear();
            stdout.read_line(&mut line)?;
        }
    }
    let addr = line
        .trim()
        .strip_prefix("atmost listening on ")
        .and_then(|a| a.parse().ok());
    match addr {
        Some(addr) => Ok((child, addr, metrics_addr)),
        None => {
            let _ = child.kill();
            let status = child.wait()?;
            Err(std::io::Error::other(format!(
                "atmost did not start ({status}); stdout said {line:?}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server started on a port another server holds fails to bind and
    /// exits; the other's answer must not pass for its own (the test whose
    /// Redis then "refused connections" mid-run when the other was killed).
    #[test]
    fn a_port_another_server_holds_is_never_taken_for_ours() {
        let first = RedisServer::start().expect("a redis-server");
        let dir =
            std::env::temp_dir().join(format!("atmost-redis-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let second = spawn_redis(first.port(), &dir, &[]);
        let _ = std::fs::remove_dir_all(&dir);
        let err = second.err().expect("the port is the first server's");
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
        let pid = first.child.as_ref().map(Tethered::pid).expect("running");
        assert_eq!(listener_is(pid, first.port()), Some(true));
    }

    #[test]
    fn no_port_is_handed_out_twice() {
        let ports: Vec<u16> = (0..2000).map(|_| free_port()).collect();
        let distinct: std::collections::BTreeSet<&u16> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len());
    }
}
