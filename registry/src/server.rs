//! Serving an opened registry over HTTP until a signal arrives: startup recovery, the
//! upload expiry task, connection limits. The only user of the HTTP layer (`api`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::clock::now_unix;
use crate::config::StorageKind;
use crate::registry::Registry;

/// Serves on `listener` until SIGINT or SIGTERM. Prints `listening on <addr>` first.
pub async fn serve(reg: Arc<Registry>, listener: TcpListener) -> anyhow::Result<()> {
    // The recorder first: the conversions the queue takes back below count from their start.
    crate::metrics::install();
    let (kept, dropped, orphans) = reg
        .recover_uploads()
        .await
        .context("recovering upload sessions")?;
    tracing::info!(kept, dropped, orphans, "upload sessions recovered");
    if let StorageKind::Fs = reg.config.storage {
        let removed = crate::store::fs::clean_tmp(&reg.config.data.join("store"))
            .context("cleaning temporary objects")?;
        if removed > 0 {
            tracing::info!(removed, "removed temporary objects of interrupted writes");
        }
    }
    crate::convert_queue::start(&reg).context("starting the conversion queue")?;
    crate::recompress::start(&reg).context("starting chunk recompression")?;
    crate::envs::start(&reg);
    reg.spawn_background(|expiry| async move {
        let every = Duration::from_secs((expiry.config.upload_ttl_secs / 4).clamp(1, 600));
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            if let Err(e) = expiry.expire_uploads(now_unix()).await {
                tracing::warn!(error = %e, "expiring upload sessions");
            }
        }
    });
    let addr = listener.local_addr()?;
    println!("listening on {addr}");
    tracing::info!(%addr, data = %reg.config.data.display(), "amber-registry serving");
    let limits = ConnLimits {
        header: Duration::from_secs(reg.config.header_timeout_secs),
        idle: Duration::from_secs(reg.config.idle_timeout_secs),
    };
    let served = serve_http(listener, crate::api::router(reg.clone()), limits).await;
    // Conversions stop at their next read or chunk write; their work items stay.
    let left = reg.stop_background(STOP_GRACE).await;
    if left > 0 {
        tracing::warn!(
            tasks = left,
            "background tasks still running at exit; their work items stay queued"
        );
    }
    served
}

/// How long the background tasks get to end once the HTTP requests are drained.
const STOP_GRACE: Duration = Duration::from_secs(20);

/// Per-connection limits: a slow client cannot hold the server.
struct ConnLimits {
    /// Time to send a request's headers, from the first byte.
    header: Duration,
    /// Longest pause in reading or writing a connection (a stalled body, an idle
    /// keep-alive connection, a client that stops reading a download).
    idle: Duration,
}

/// The HTTP/1.1 + HTTP/2 accept loop with header and idle timeouts, until SIGINT or
/// SIGTERM; then open connections finish their requests (up to 30 s).
async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
) -> anyhow::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.idle / 2))
        .keep_alive_timeout(limits.idle / 2);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            conn = listener.accept() => match conn {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: keep serving the others.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
        stream.set_read_timeout(Some(limits.idle));
        stream.set_write_timeout(Some(limits.idle));
        let io = TokioIo::new(Box::pin(stream));
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection_with_upgrades(io, svc).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(30)) => {
            tracing::warn!("connections still open after 30 s; closing them");
        }
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
    tracing::info!("shutting down");
}
