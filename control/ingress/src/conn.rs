//! The HTTP/1.1 connection loop: accepts on a listener (plain TCP or TLS) and serves each
//! connection with hyper under a timer, so that a client must send each request's headers
//! within the header read timeout or lose the connection (slow-header clients cannot hold
//! connections open); on shutdown it stops accepting, closes idle keep-alive connections
//! and lets every connection finish the request it is serving.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::serve::Listener;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

/// The kernel send buffer of each connection (the kernel doubles it for its own accounting).
/// Fixed rather than autotuned (up to 4 MiB on Linux), so that what a client that stops
/// reading can leave in the kernel stays small: the rest waits in ingress, where it is
/// counted against `--stream-buffer-bytes`.
pub(crate) const SEND_BUFFER_BYTES: usize = 64 << 10;

/// Unsent bytes the kernel holds for a connection at most beyond what the client's receive
/// window lets out (`TCP_NOTSENT_LOWAT`): past them the socket is not writable, so output for
/// a client that stops reading backs up into ingress after its window fills, not 128 KiB later.
pub(crate) const NOTSENT_LOWAT_BYTES: u32 = 16 << 10;

/// Sets up an accepted connection: no Nagle delay, the fixed send buffer, the unsent-bytes
/// bound, and `send_timeout` as `TCP_USER_TIMEOUT`: a connection whose client acknowledges
/// nothing, or keeps its receive window shut (it stopped reading), while the server has bytes
/// for it, is closed by the kernel after that long, which ends its requests.
pub(crate) fn tune(tcp: &tokio::net::TcpStream, send_timeout: Duration) {
    let _ = tcp.set_nodelay(true);
    let sock = socket2::SockRef::from(tcp);
    let _ = sock.set_send_buffer_size(SEND_BUFFER_BYTES);
    #[cfg(target_os = "linux")]
    {
        let _ = sock.set_tcp_notsent_lowat(NOTSENT_LOWAT_BYTES);
        let _ = sock.set_tcp_user_timeout(Some(send_timeout.max(Duration::from_millis(1))));
    }
    #[cfg(not(target_os = "linux"))]
    let _ = send_timeout;
}

/// Serves `app` on `listener` until `shutdown` completes, then until every connection has
/// closed (idle ones at once, busy ones after their request).
pub(crate) async fn serve<L: Listener>(
    mut listener: L,
    app: Router,
    header_read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let io = tokio::select! {
            (io, _) = listener.accept() => io,
            () = &mut shutdown => break,
        };
        let svc = TowerToHyperService::new(app.clone());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(io), svc));
        tokio::spawn(async move {
            // A connection's end (a client that went away, a timeout) concerns it alone.
            let _ = conn.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
