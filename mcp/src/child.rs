//! The upstream as a child process: MCP over its stdin and stdout, one
//! JSON-RPC message per line (rmcp's line transport), with its stdin
//! written through [`Stdin`], which tells whether a failed write left the
//! message being sent wholly unwritten.
//!
//! rmcp's own `TokioChildProcess` writes the child's stdin out of sight,
//! and its `BrokenPipe` does not say how much of the request went before
//! it. EPIPE only says that the failing `write(2)` delivered nothing; the
//! bytes of earlier writes may all have been read. A request larger than
//! the room left in the pipe goes in several writes, the last of which may
//! hold only its newline, and a child that decodes a JSON value where it
//! ends (as the official Go SDK does, with `json.Decoder`) can act on the
//! request and exit before the proxy writes that newline. So a broken pipe
//! counts as "not sent" only when no byte of the message had been written
//! ([`nothing_written`]).

use rmcp::RoleClient;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use rmcp::transport::async_rw::AsyncRwTransport;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::process::Stdio;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::AsyncWrite;
use tokio::process::{ChildStdin, ChildStdout, Command};

/// How long a child whose stdin was closed may take to exit before it is
/// killed.
const EXIT_GRACE: Duration = Duration::from_secs(3);

/// The upstream child process and the MCP transport over its stdio. It is
/// killed if dropped while running.
pub struct ChildProcess {
    child: tokio::process::Child,
    io: AsyncRwTransport<RoleClient, ChildStdout, Stdin<ChildStdin>>,
}

impl ChildProcess {
    /// Starts `command` with piped stdin and stdout; its stderr is the
    /// proxy's.
    pub fn spawn(mut command: Command) -> io::Result<Self> {
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(io::Error::other("the child's stdio was not piped"));
        };
        Ok(Self {
            child,
            io: AsyncRwTransport::new_client(stdout, Stdin::new(stdin)),
        })
    }
}

impl Transport<RoleClient> for ChildProcess {
    type Error = io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), io::Error>> + Send + 'static {
        self.io.send(item)
    }

    fn receive(&mut self) -> impl Future<Output = Option<RxJsonRpcMessage<RoleClient>>> + Send {
        self.io.receive()
    }

    /// MCP's stdio shutdown: the child's stdin is closed, and a child that
    /// has not exited within [`EXIT_GRACE`] is killed.
    async fn close(&mut self) -> io::Result<()> {
        self.io.close().await?;
        if tokio::time::timeout(EXIT_GRACE, self.child.wait())
            .await
            .is_err()
        {
            self.child.kill().await?;
        }
        Ok(())
    }
}

/// Whether a send's error proves that no byte of the message reached the
/// child: its stdin was closed before the message's first byte was
/// written.
pub fn nothing_written(error: &io::Error) -> bool {
    error.get_ref().is_some_and(|e| e.is::<NothingWritten>())
}

#[derive(Debug, thiserror::Error)]
#[error("the child's stdin is closed: no byte of the message was written (Broken pipe)")]
struct NothingWritten;

/// A writer of newline-ended messages that marks a `BrokenPipe` with
/// [`NothingWritten`] when it proves that the message being sent was not
/// written at all.
///
/// It relies on how rmcp writes: each send appends one message, ended by
/// its only newline, to the writer's buffer and writes the buffer out
/// before the next send begins (rmcp's transport holds a lock across the
/// send). So the message being sent is the buffer's last line, and:
///
/// - when a write fails with EPIPE right after a newline (or before any
///   byte), every line still in the buffer, the message being sent among
///   them, is wholly unwritten, since the failing write delivered nothing;
/// - after one EPIPE the pipe's read end stays closed, and a message sent
///   later was put in the buffer after the pipe broke, so none of it is
///   ever written (an unwritten tail of the earlier message may precede it
///   in the buffer).
///
/// Any other failure, and an EPIPE in the middle of a line, stays a plain
/// error: the message may have been read in part or whole.
struct Stdin<W> {
    inner: W,
    /// The last byte written was not a newline: a line is partly written.
    mid_line: bool,
    /// A write failed with EPIPE: nothing written from now on is read.
    broken: bool,
}

impl<W> Stdin<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            mid_line: false,
            broken: false,
        }
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Stdin<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.broken {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                NothingWritten,
            )));
        }
        let written = ready!(Pin::new(&mut self.inner).poll_write(cx, buf));
        match written {
            Ok(n) => {
                if let Some(last) = buf[..n].last() {
                    self.mid_line = *last != b'\n';
                }
                Poll::Ready(Ok(n))
            }
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                self.broken = true;
                if self.mid_line {
                    Poll::Ready(Err(e))
                } else {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        NothingWritten,
                    )))
                }
            }
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmcp::model::{ClientJsonRpcMessage, ClientRequest, PingRequest, RequestId};
    use tokio::io::AsyncReadExt;
    use tokio::net::unix::pipe;

    /// A transport writing to a real pipe, whose read end the test holds.
    fn transport() -> (
        AsyncRwTransport<RoleClient, pipe::Receiver, Stdin<pipe::Sender>>,
        pipe::Receiver,
    ) {
        let (sender, receiver) = pipe::pipe().unwrap();
        // The transport's own read side, which these tests do not read.
        let (_, unread) = pipe::pipe().unwrap();
        (
            AsyncRwTransport::new_client(unread, Stdin::new(sender)),
            receiver,
        )
    }

    /// A request of about `size` bytes (a ping with a long id).
    fn request(size: usize) -> TxJsonRpcMessage<RoleClient> {
        ClientJsonRpcMessage::request(
            ClientRequest::PingRequest(PingRequest::default()),
            RequestId::String("x".repeat(size).into()),
        )
    }

    #[tokio::test]
    async fn a_pipe_closed_before_the_message_writes_nothing_of_it() {
        let (mut transport, receiver) = transport();
        drop(receiver);
        let error = transport.send(request(10)).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
        assert!(nothing_written(&error), "{error}");
    }

    #[tokio::test]
    async fn a_pipe_closed_after_the_child_read_part_of_the_message_may_have_delivered_it() {
        let (mut transport, mut receiver) = transport();
        // Larger than the pipe: it goes in several writes.
        let send = tokio::spawn(transport.send(request(1 << 20)));
        let mut head = vec![0; 1000];
        receiver.read_exact(&mut head).await.unwrap();
        drop(receiver);
        let error = send.await.unwrap().unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
        assert!(!nothing_written(&error), "{error}");
        // The pipe stays broken: nothing of a later message is written,
        // though the earlier one's unwritten tail comes first.
        let later = transport.send(request(10)).await.unwrap_err();
        assert!(nothing_written(&later), "{later}");
    }

    #[tokio::test]
    async fn a_pipe_closed_between_messages_writes_nothing_of_the_next() {
        let (mut transport, mut receiver) = transport();
        transport.send(request(10)).await.unwrap();
        let mut line = Vec::new();
        while line.last() != Some(&b'\n') {
            let mut byte = [0];
            receiver.read_exact(&mut byte).await.unwrap();
            line.push(byte[0]);
        }
        drop(receiver);
        let error = transport.send(request(10)).await.unwrap_err();
        assert!(nothing_written(&error), "{error}");
    }

    #[test]
    fn other_errors_are_not_marked() {
        assert!(!nothing_written(&io::Error::from(
            io::ErrorKind::BrokenPipe
        )));
        assert!(!nothing_written(&io::Error::other("x")));
    }
}
