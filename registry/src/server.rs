//! Opening a registry from its configuration and serving it until a signal arrives.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::config::{Config, StorageKind};
use crate::index::Index;
use crate::registry::{now_unix, Registry};
use crate::store::fs::FsStore;
use crate::store::ObjectStore;

/// Opens the index and the object store under the configured data directory.
pub async fn open(config: Config) -> anyhow::Result<Arc<Registry>> {
    std::fs::create_dir_all(&config.data)
        .with_context(|| format!("creating data directory {}", config.data.display()))?;
    let index_dir = config.data.join("index");
    let index = Index::open(&index_dir)
        .with_context(|| format!("opening index at {}", index_dir.display()))?;
    let store = open_store(&config).await?;
    let auth = match (config.auth.as_str(), &config.users) {
        ("token", Some(users)) => Some(
            crate::auth::Auth::open(
                users,
                &config.data.join("auth").join("token.key"),
                "amber".into(),
                Duration::from_secs(config.token_ttl_secs),
            )
            .context("loading accounts")?,
        ),
        _ => None,
    };
    let mut reg = Registry::new(config, index, store);
    reg.auth = auth;
    Ok(Arc::new(reg))
}

/// Opens the configured object store.
pub async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn ObjectStore>> {
    Ok(match config.storage {
        StorageKind::Fs => {
            let root = config.data.join("store");
            Arc::new(
                FsStore::open(&root)
                    .with_context(|| format!("opening store at {}", root.display()))?,
            )
        }
        StorageKind::S3 => {
            let settings = config.s3_settings();
            Arc::new(
                crate::store::s3::S3Store::connect(&settings)
                    .await
                    .with_context(|| {
                        format!("opening the S3 store (bucket {})", settings.bucket)
                    })?,
            )
        }
    })
}

/// Serves on `listener` until SIGINT or SIGTERM. Prints `listening on <addr>` first.
pub async fn serve(reg: Arc<Registry>, listener: TcpListener) -> anyhow::Result<()> {
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
    let resumed = crate::convert::resume(&reg).context("resuming conversions")?;
    if resumed > 0 {
        tracing::info!(resumed, "resumed unfinished conversions");
    }
    let expiry = reg.clone();
    tokio::spawn(async move {
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
    axum::serve(listener, crate::api::router(reg))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving HTTP")
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
