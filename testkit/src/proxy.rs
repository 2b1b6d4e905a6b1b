//! A loopback TCP proxy in front of a real Redis, to make its replies slow
//! or lose them while the commands still reach Redis and run.
//!
//! The proxy listens on `127.0.0.1:0` and forwards every connection to the
//! target. Client -> server bytes always flow at once; server -> client
//! bytes (the replies) follow the current [`Mode`], which a test switches at
//! runtime. Every client -> server command is parsed (RESP) and logged, so a
//! test can count, say, how many `FCALL` carrying its idempotency key
//! reached Redis. Dropping the proxy closes the listener and every
//! connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What happens to the replies (server -> client bytes). A switch also
/// applies to replies already held back: back to `Pass`, they go at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Replies are forwarded as they come.
    Pass,
    /// Each reply is written this long after Redis sent it (order is kept:
    /// a reply never overtakes an earlier one).
    Delay(Duration),
    /// Replies are swallowed: the commands reached Redis and ran, their
    /// answers are lost. A TCP stream cannot lose bytes in its middle, so a
    /// connection that lost a reply is closed as soon as the mode leaves
    /// `DropReplies`: the client then sees a broken connection, as after a
    /// real network failure, never a reply meant for another command.
    DropReplies,
}

/// Replies held until the mode changes.
pub const HOLD: Mode = Mode::Delay(Duration::from_secs(24 * 3600));

/// A client -> server command: its arguments, the command name first.
pub type Command = Vec<Vec<u8>>;

struct Shared {
    target: SocketAddr,
    mode: watch::Sender<Mode>,
    commands: Mutex<Vec<Command>>,
    swallowed: AtomicUsize,
    /// Reply chunks read from Redis and not yet written to the client.
    pending: AtomicUsize,
    /// (command name, argument needle): the next such command switches the
    /// mode to [`HOLD`] before it reaches Redis ([`Proxy::hold_from`]).
    hold_from: Mutex<Option<(Vec<u8>, Vec<u8>)>>,
}

pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl Proxy {
    /// A proxy to `target`, in pass-through mode.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, _) = watch::channel(Mode::Pass);
        let shared = Arc::new(Shared {
            target,
            mode,
            commands: Mutex::new(Vec::new()),
            swallowed: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            hold_from: Mutex::new(None),
        });
        let stop = CancellationToken::new();
        tokio::spawn(accept(listener, shared.clone(), stop.clone()));
        Self { addr, shared, stop }
    }

    /// A proxy to the Redis at `url` (`redis://127.0.0.1:PORT`).
    pub async fn for_redis(url: &str) -> Self {
        let host_port = url
            .strip_prefix("redis://")
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_else(|| panic!("not a plain redis:// URL: {url}"));
        Self::start(host_port.parse().expect("a loopback IP:PORT")).await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL to give a Redis client instead of the real one.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Switches the mode for every connection, open or future.
    pub fn set_mode(&self, mode: Mode) {
        self.shared.mode.send_replace(mode);
    }

    pub fn mode(&self) -> Mode {
        *self.shared.mode.borrow()
    }

    /// Holds the replies from the next command named `name`
    /// (case-insensitive) with an argument containing `needle` on: the mode
    /// becomes [`HOLD`] before that command reaches Redis, so the command
    /// runs and its reply, and every later one, waits until the mode
    /// changes. A client that waits for that reply is stopped exactly
    /// there, whatever the timing.
    pub fn hold_from(&self, name: &str, needle: &str) {
        *self.shared.hold_from.lock().expect("hold_from") =
            Some((name.as_bytes().to_vec(), needle.as_bytes().to_vec()));
    }

    /// Commands forwarded to Redis so far that contain `needle` in one of
    /// their arguments (the name included).
    pub fn count(&self, needle: &str) -> usize {
        self.count_where(|c| c.iter().any(|a| contains(a, needle.as_bytes())))
    }

    /// Commands named `name` (case-insensitive) forwarded so far that
    /// contain `needle` in one of their arguments (any, if it is empty).
    pub fn count_command(&self, name: &str, needle: &str) -> usize {
        self.count_where(|c| {
            c.first()
                .is_some_and(|n| n.eq_ignore_ascii_case(name.as_bytes()))
                && (needle.is_empty() || c[1..].iter().any(|a| contains(a, needle.as_bytes())))
        })
    }

    fn count_where(&self, f: impl Fn(&Command) -> bool) -> usize {
        let commands = self.shared.commands.lock().expect("command log");
        commands.iter().filter(|c| f(c)).count()
    }

    /// Every command forwarded so far, lossily as text (for messages).
    pub fn commands(&self) -> Vec<String> {
        let commands = self.shared.commands.lock().expect("command log");
        commands
            .iter()
            .map(|c| {
                c.iter()
                    .map(|a| {
                        let s = String::from_utf8_lossy(a);
                        s.chars().take(60).collect::<String>()
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    /// Reply bytes swallowed in [`Mode::DropReplies`] so far.
    pub fn swallowed_bytes(&self) -> usize {
        self.shared.swallowed.load(Ordering::SeqCst)
    }

    /// Waits until `count(needle)` reaches `n`; false if it did not within
    /// `within`.
    pub async fn wait_count(&self, needle: &str, n: usize, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.count(needle) >= n {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until every reply read from Redis so far has been written to
    /// its client (delayed ones included); false if not within `within`.
    pub async fn wait_flushed(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.shared.pending.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

async fn accept(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => {
                if let Ok((client, _)) = accepted {
                    tokio::spawn(connection(client, shared.clone(), stop.child_token()));
                }
            }
        }
    }
}

/// One proxied connection; both sockets close when it returns.
async fn connection(client: TcpStream, shared: Arc<Shared>, stop: CancellationToken) {
    let server = tokio::select! {
        () = stop.cancelled() => return,
        server = TcpStream::connect(shared.target) => match server {
            Ok(server) => server,
            // Redis is down: the client sees its connection closed.
            Err(_) => return,
        },
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (queue, queued) = mpsc::unbounded_channel();
    let pending = Pending {
        shared: &shared,
        here: AtomicUsize::new(0),
    };
    let replies = async {
        tokio::join!(
            read_replies(server_read, queue, &shared, &pending, &stop),
            write_replies(queued, client_write, &shared, &pending),
        )
    };
    tokio::select! {
        () = stop.cancelled() => {}
        () = forward_commands(client_read, server_write, &shared) => {}
        _ = replies => {}
    }
}

/// Reply chunks of one connection queued and not yet written; on drop
/// (the connection is gone) they no longer count as pending.
struct Pending<'a> {
    shared: &'a Shared,
    here: AtomicUsize,
}

impl Pending<'_> {
    fn add(&self) {
        self.here.fetch_add(1, Ordering::SeqCst);
        self.shared.pending.fetch_add(1, Ordering::SeqCst);
    }

    fn done(&self) {
        self.here.fetch_sub(1, Ordering::SeqCst);
        self.shared.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let left = self.here.swap(0, Ordering::SeqCst);
        self.shared.pending.fetch_sub(left, Ordering::SeqCst);
    }
}

/// Client -> server: forwards at once (switching to [`HOLD`] first when a
/// command completed here is the one [`Proxy::hold_from`] names), then logs
/// the complete commands.
async fn forward_commands(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, shared: &Shared) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut parser = Parser::default();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let commands = parser.feed(&buf[..n]);
        {
            let mut hold_from = shared.hold_from.lock().expect("hold_from");
            let armed = hold_from.as_ref().is_some_and(|(name, needle)| {
                commands.iter().any(|c| {
                    c.first().is_some_and(|n| n.eq_ignore_ascii_case(name))
                        && c[1..].iter().any(|a| contains(a, needle))
                })
            });
            if armed {
                *hold_from = None;
                shared.mode.send_replace(HOLD);
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if !commands.is_empty() {
            shared
                .commands
                .lock()
                .expect("command log")
                .extend(commands);
        }
    }
}

/// Server -> proxy: queues each reply chunk for the writer with the time it
/// was read, or swallows it; closes the connection (through `stop`) once
/// the mode leaves DropReplies after a reply was swallowed.
async fn read_replies(
    mut from: OwnedReadHalf,
    queue: mpsc::UnboundedSender<(Instant, Vec<u8>)>,
    shared: &Shared,
    pending: &Pending<'_>,
    stop: &CancellationToken,
) {
    let mut mode = shared.mode.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    let mut lost_a_reply = false;
    loop {
        tokio::select! {
            read = from.read(&mut buf) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if *mode.borrow_and_update() == Mode::DropReplies {
                    lost_a_reply = true;
                    shared.swallowed.fetch_add(n, Ordering::SeqCst);
                    continue;
                }
                pending.add();
                if queue.send((Instant::now(), buf[..n].to_vec())).is_err() {
                    pending.done();
                    return;
                }
            }
            changed = mode.changed() => {
                if changed.is_err() {
                    return;
                }
                let current = *mode.borrow_and_update();
                if lost_a_reply && current != Mode::DropReplies {
                    stop.cancel();
                    return;
                }
            }
        }
    }
}

/// Proxy -> client: writes each queued chunk, in order, once the current
/// mode's delay has passed since it was read.
async fn write_replies(
    mut queued: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    pending: &Pending<'_>,
) {
    let mut mode = shared.mode.subscribe();
    'chunks: while let Some((read_at, bytes)) = queued.recv().await {
        loop {
            let delay = match *mode.borrow_and_update() {
                Mode::Delay(d) => d,
                Mode::Pass | Mode::DropReplies => Duration::ZERO,
            };
            let at = read_at + delay;
            if at <= Instant::now() {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep_until(at) => break,
                changed = mode.changed() => {
                    if changed.is_err() {
                        pending.done();
                        break 'chunks;
                    }
                }
            }
        }
        let written = to.write_all(&bytes).await;
        pending.done();
        if written.is_err() {
            break;
        }
    }
    // Whatever is still queued will never be written.
    queued.close();
    while queued.try_recv().is_ok() {
        pending.done();
    }
}

/// An incremental parser of client commands: RESP arrays of bulk strings,
/// or inline commands.
#[derive(Default)]
struct Parser {
    buf: Vec<u8>,
}

impl Parser {
    fn feed(&mut self, bytes: &[u8]) -> Vec<Command> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut at = 0;
        while let Some((command, used)) = parse(&self.buf[at..]) {
            at += used;
            if !command.is_empty() {
                out.push(command);
            }
        }
        self.buf.drain(..at);
        out
    }
}

/// One line ending in CRLF (or LF) at the start of `buf`: (line, bytes used).
fn line(buf: &[u8]) -> Option<(&[u8], usize)> {
    let end = buf.iter().position(|&b| b == b'\n')?;
    let text = buf[..end].strip_suffix(b"\r").unwrap_or(&buf[..end]);
    Some((text, end + 1))
}

fn number(text: &[u8]) -> Option<usize> {
    std::str::from_utf8(text).ok()?.trim().parse().ok()
}

/// One complete command at the start of `buf`: (command, bytes used), or
/// None when more bytes are needed.
fn parse(buf: &[u8]) -> Option<(Command, usize)> {
    if buf.first() != Some(&b'*') {
        let (text, used) = line(buf)?;
        let command = text
            .split(|b| b.is_ascii_whitespace())
            .filter(|w| !w.is_empty())
            .map(<[u8]>::to_vec)
            .collect();
        return Some((command, used));
    }
    let (header, mut used) = line(buf)?;
    // Malformed: skip the line rather than stall the log.
    let Some(count) = number(&header[1..]) else {
        return Some((Vec::new(), used));
    };
    let mut command = Vec::with_capacity(count);
    for _ in 0..count {
        let (header, n) = line(&buf[used..])?;
        used += n;
        let len = match header.first() {
            Some(b'$') => number(&header[1..]),
            _ => None,
        };
        let Some(len) = len else {
            return Some((Vec::new(), used));
        };
        if buf.len() < used + len + 2 {
            return None;
        }
        command.push(buf[used..used + len].to_vec());
        used += len + 2;
    }
    Some((command, used))
}
