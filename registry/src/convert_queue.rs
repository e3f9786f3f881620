//! The conversion queue, shared by every replica over one store. Each image waiting for
//! or undergoing conversion is a work item record (`_records/work/conversions/<image>`);
//! a replica claims one by writing its id and a lease expiry into it with
//! compare-and-swap, renews the lease while it converts, records the outcome
//! (`_records/conversions/<image>`) and then removes the item. Every replica sweeps the
//! work items every third of a lease, so a conversion queued or started by a replica that
//! died is taken over by another one once its lease runs out, and a replica with free
//! workers takes queued items another replica has not reached yet. Within a replica,
//! `convert_workers` workers each convert one image, then the next lined-up one
//! (`Registry::take_conversion`); an item is claimed only when a worker starts on it, so
//! what waits in one replica's line stays free for any other. The line holds at most
//! `convert_line` images: past it, an item waits in the store alone, and the sweeper
//! takes more (in key order, a page at a time) when the line is down to half
//! (`Registry::conversion_refill`) or at its next pass. So a backlog of any length costs
//! a replica the same memory, and a pass reads only as far as it has room.
//!
//! Invariants kept here:
//! - an item is created before the manifest push that queued it is acknowledged, so an
//!   acknowledged image is converted even if its replica dies at once;
//! - an outcome is recorded before its item is removed, so an item without a success
//!   recorded is unfinished work (or a retry of a failure), and an item with one is a
//!   leftover to remove;
//! - one process runs at most one conversion of an image at a time (`Registry::converting`);
//!   two replicas may convert the same image only when a lease expired under a live
//!   replica (a pause longer than the lease), which is harmless: conversion is
//!   deterministic and its outputs are content-addressed, and the first outcome recorded
//!   is kept (a success replaces a failure);
//! - a replica's id is stable across restarts (`<data>/replica-id`), so a replica that
//!   restarts takes its own unfinished conversions back without waiting for their leases.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;

use crate::clock::now_unix;
use crate::convert::{convert_image, CONVERSIONS_FAILED, CONVERSIONS_STARTED};
use crate::index::{Conversion, ConversionState};
use crate::records::RecordError;
use crate::registry::{Registry, Taken};
use crate::store::{RecordKey, Version};
use amber_oci::digest::Digest;
use amber_oci::manifest::{ManifestKind, ParsedManifest};
use amber_oci::names::RepoName;

/// Conversions taken over from another replica whose lease ran out.
pub const CONVERSIONS_TAKEN_OVER: &str = "amber_conversions_taken_over_total";

/// A queued or running conversion, as stored in its work item record.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkItem {
    /// The repository the image was pushed to (its layers are linked there).
    pub repo: String,
    pub queued_unix: u64,
    /// The replica converting it, while one is.
    #[serde(default)]
    pub owner: Option<String>,
    /// Until when `owner`'s claim holds, unless renewed (unix seconds).
    #[serde(default)]
    pub lease_until_unix: u64,
}

impl WorkItem {
    /// Whether replica `me` may claim the item at `now`: nobody holds it, its holder's
    /// lease ran out, or `me` held it before a restart.
    fn claimable(&self, me: &str, now: u64) -> bool {
        match &self.owner {
            None => true,
            Some(owner) => owner == me || self.lease_until_unix <= now,
        }
    }

    /// Whether a replica holds the item at `now`.
    fn running(&self, now: u64) -> bool {
        self.owner.is_some() && self.lease_until_unix > now
    }
}

fn corrupt(key: &RecordKey, e: impl std::fmt::Display) -> RecordError {
    RecordError::Corrupt {
        key: key.as_str().to_string(),
        why: e.to_string(),
    }
}

impl Registry {
    /// Image `image`'s work item and its version, if it has one.
    pub async fn conversion_work(
        &self,
        image: &Digest,
    ) -> Result<Option<(WorkItem, Version)>, RecordError> {
        let key = RecordKey::conversion_work(image);
        match self.store.get_record(&key).await? {
            None => Ok(None),
            Some((v, version)) => Ok(Some((
                serde_json::from_slice(&v).map_err(|e| corrupt(&key, e))?,
                version,
            ))),
        }
    }

    async fn put_conversion_work(
        &self,
        image: &Digest,
        item: &WorkItem,
        expected: Option<&Version>,
    ) -> Result<Option<Version>, RecordError> {
        Ok(self
            .store
            .put_record(
                &RecordKey::conversion_work(image),
                Bytes::from(serde_json::to_vec(item).expect("json")),
                expected,
            )
            .await?)
    }

    /// The state of a conversion that has no outcome yet, from its work item.
    pub async fn pending_conversion(
        &self,
        image: &Digest,
    ) -> Result<Option<Conversion>, RecordError> {
        Ok(self
            .conversion_work(image)
            .await?
            .map(|(item, _)| Conversion {
                state: if item.running(now_unix()) {
                    ConversionState::Running
                } else {
                    ConversionState::Queued
                },
                repo: item.repo,
                error: None,
                env_digest: None,
                updated_unix: item.queued_unix,
                started_unix: None,
            }))
    }
}

/// Image config media types whose manifests are container images (others are artifacts).
fn is_image_config(media_type: &str) -> bool {
    matches!(
        media_type,
        amber_oci::media::OCI_CONFIG | amber_oci::media::DOCKER_CONFIG
    )
}

/// Decides what a pushed (already validated) manifest means for conversion; queues the
/// image if needed (in the shared queue, `convert_queue`, before the push is acknowledged).
pub async fn on_manifest_pushed(
    reg: &Arc<Registry>,
    repo: &RepoName,
    digest: &Digest,
    parsed: &ParsedManifest,
) {
    let target = match parsed.kind {
        ManifestKind::Image => {
            let config_ok = parsed
                .blobs
                .first()
                .is_some_and(|c| is_image_config(&c.media_type));
            if !config_ok || parsed.subject.is_some() {
                return; // an artifact, not a container image
            }
            digest.clone()
        }
        ManifestKind::Index => match parsed.linux_amd64() {
            Some(d) => d.digest.clone(),
            None => return,
        },
    };
    if let Err(e) = enqueue(reg, repo, &target).await {
        tracing::error!(error = %format!("{e:#}"), image = %target, "queueing conversion");
    }
}

/// Queues `image` (pushed to `repo`) unless it has an env digest or is queued already,
/// and starts converting it here when a worker is free. Returns once the work item is
/// durable in the store.
pub async fn enqueue(reg: &Arc<Registry>, repo: &RepoName, image: &Digest) -> anyhow::Result<()> {
    if reg.index.image_env(image)?.is_some() {
        return Ok(());
    }
    if let Some(c) = reg.conversion(image).await? {
        if c.state == ConversionState::Done {
            return Ok(());
        }
    }
    let now = now_unix();
    let item = WorkItem {
        repo: repo.to_string(),
        queued_unix: now,
        owner: None,
        lease_until_unix: 0,
    };
    // Create-only: an item that exists already stands for the same work.
    reg.put_conversion_work(image, &item, None).await?;
    let queued = Conversion {
        repo: repo.to_string(),
        state: ConversionState::Queued,
        error: None,
        env_digest: None,
        updated_unix: now,
        started_unix: None,
    };
    reg.index.put_conversion(image, &queued)?;
    run_here(reg, image.clone());
    Ok(())
}

/// Starts the sweeper: at once (taking back this replica's own unfinished conversions and
/// queueing, from the index, those of a version that kept its queue there), then every
/// third of a lease.
pub fn start(reg: &Arc<Registry>) -> anyhow::Result<()> {
    reg.spawn_background(move |reg| async move {
        if let Err(e) = requeue_from_index(&reg).await {
            tracing::warn!(error = %format!("{e:#}"), "re-queueing conversions the index holds");
        }
        let every = Duration::from_secs((reg.config.conversion_lease_secs / 3).max(1));
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = reg.conversion_refill.notified() => {}
            }
            match sweep(&reg).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(started = n, "conversions taken from the shared queue"),
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "sweeping the conversion queue")
                }
            }
        }
    });
    Ok(())
}

/// Index conversion records read at a time when re-queueing those of the index.
const INDEX_PAGE: usize = 1000;

/// Queues, as shared work items, the conversions the index says are queued or running
/// but which have no work item (a version before the shared queue kept its queue in the
/// index). Reads the index a page at a time: memory stays that of one page however many
/// images the index holds (a million records read at once were most of a starting
/// registry's peak memory).
async fn requeue_from_index(reg: &Arc<Registry>) -> anyhow::Result<()> {
    let mut after: Option<Digest> = None;
    loop {
        let page = reg.index.conversions_page(after.as_ref(), INDEX_PAGE)?;
        let full = page.len() == INDEX_PAGE;
        after = page.last().map(|(d, _)| d.clone());
        for (image, c) in page {
            if !matches!(c.state, ConversionState::Queued | ConversionState::Running) {
                continue;
            }
            if reg.conversion_work(&image).await?.is_some() {
                continue;
            }
            if let Ok(repo) = RepoName::parse(&c.repo) {
                if let Err(e) = enqueue(reg, &repo, &image).await {
                    tracing::warn!(%image, error = %format!("{e:#}"), "re-queueing a conversion");
                }
            }
        }
        if !full {
            return Ok(());
        }
    }
}

/// Work items a sweep lists at a time.
const SWEEP_PAGE: usize = 1000;

/// One pass over the shared queue, in key order: removes items whose outcome is
/// recorded, and takes here every item nobody holds until this process's line is full.
/// Returns how many it took.
pub async fn sweep(reg: &Arc<Registry>) -> anyhow::Result<usize> {
    if reg.config.convert_workers == 0 {
        return Ok(0);
    }
    let mut started = 0;
    let me = reg.replica_id.as_str();
    let mut after: Option<String> = None;
    loop {
        let page = reg
            .store
            .list_records_page(RecordKey::CONVERSION_WORK, after.as_deref(), SWEEP_PAGE)
            .await?;
        let Some(last) = page.last() else {
            return Ok(started);
        };
        after = last
            .as_str()
            .strip_prefix(RecordKey::CONVERSION_WORK)
            .map(str::to_string);
        for key in &page {
            let Some(image) = key
                .as_str()
                .strip_prefix(RecordKey::CONVERSION_WORK)
                .and_then(|d| d.parse::<Digest>().ok())
            else {
                continue;
            };
            if reg.is_converting(&image) {
                continue;
            }
            if done(reg, &image).await? {
                // Its converter died between recording the outcome and removing the item.
                reg.store.delete_record(key).await?;
                continue;
            }
            let Some((item, _)) = reg.conversion_work(&image).await? else {
                continue;
            };
            if !item.claimable(me, now_unix()) {
                continue;
            }
            match run_here(reg, image) {
                Taken::Start | Taken::LinedUp => started += 1,
                Taken::Already => {}
                // The rest waits for the line to empty (`Registry::conversion_refill`).
                Taken::Full => return Ok(started),
            }
        }
        if page.len() < SWEEP_PAGE {
            return Ok(started);
        }
    }
}

/// Whether `image`'s conversion succeeded (here or on another replica; cached in the
/// index). A failure is not final: pushing the image again queues another attempt.
async fn done(reg: &Registry, image: &Digest) -> Result<bool, RecordError> {
    Ok(reg
        .conversion(image)
        .await?
        .is_some_and(|c| c.state == ConversionState::Done))
}

/// Takes `image` into this process's conversions (`Registry::take_conversion`), and
/// starts a worker on it when one is free. A process without workers takes nothing
/// (`Taken::Full`).
fn run_here(reg: &Arc<Registry>, image: Digest) -> Taken {
    if reg.config.convert_workers == 0 {
        return Taken::Full;
    }
    let taken = reg.take_conversion(&image);
    if taken == Taken::Start {
        spawn_worker(reg, image);
    }
    taken
}

/// A worker: converts `image`, then each lined-up image in turn until none is left or
/// the server stops. Tracked but not cancelled at an await (`Registry::spawn_tracked`):
/// a conversion runs on a blocking thread, and it ends by itself at shutdown.
fn spawn_worker(reg: &Arc<Registry>, image: Digest) {
    reg.spawn_tracked(move |reg| async move {
        let mut image = image;
        loop {
            if !reg.stopping.is_cancelled() {
                if let Err(e) = claim_and_convert(&reg, &image).await {
                    tracing::warn!(%image, error = %format!("{e:#}"), "conversion could not be run");
                }
            }
            match reg.next_conversion(&image) {
                Some(next) => image = next,
                None => break,
            }
        }
    });
}

/// Claims the work item and converts the image, renewing the lease meanwhile; then
/// records the outcome and removes the item.
async fn claim_and_convert(reg: &Arc<Registry>, image: &Digest) -> anyhow::Result<()> {
    let me = reg.replica_id.clone();
    let lease = reg.config.conversion_lease_secs;
    let (item, version) = loop {
        let Some((mut item, version)) = reg.conversion_work(image).await? else {
            // Finished (here or elsewhere) while it was lined up.
            done(reg, image).await?;
            return Ok(());
        };
        let now = now_unix();
        if !item.claimable(&me, now) {
            return Ok(()); // another replica holds it; the sweeper watches its lease
        }
        let taken_over = item.owner.as_ref().is_some_and(|o| *o != me);
        item.owner = Some(me.clone());
        item.lease_until_unix = now + lease;
        if let Some(v) = reg
            .put_conversion_work(image, &item, Some(&version))
            .await?
        {
            if taken_over {
                metrics::counter!(CONVERSIONS_TAKEN_OVER).increment(1);
                tracing::info!(%image, "conversion taken over from a replica whose lease ran out");
            }
            break (item, v);
        }
        // Someone else wrote the item meanwhile: look again.
    };
    if done(reg, image).await? {
        reg.store
            .delete_record(&RecordKey::conversion_work(image))
            .await?;
        return Ok(());
    }
    let mut c = Conversion {
        repo: item.repo.clone(),
        state: ConversionState::Running,
        error: None,
        env_digest: None,
        updated_unix: now_unix(),
        started_unix: Some(now_unix()),
    };
    reg.index.put_conversion(image, &c)?;
    metrics::counter!(CONVERSIONS_STARTED).increment(1);
    tracing::info!(%image, repo = %c.repo, "conversion started");

    let renewal = tokio::spawn(renew(reg.clone(), image.clone(), item, version));
    let handle = Handle::current();
    let job_reg = reg.clone();
    let job_image = image.clone();
    let repo = c.repo.clone();
    let result =
        tokio::task::spawn_blocking(move || convert_image(&job_reg, &handle, &repo, &job_image))
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("conversion task panicked: {e}")));
    renewal.abort();
    if result.is_err() && reg.stopping.is_cancelled() {
        // Cut short by the shutdown (`convert::Stopping`), or failed while it began: no
        // outcome either way. The item stays with this replica's id: a restart takes it
        // back at once, another replica when the lease runs out.
        tracing::info!(%image, "conversion stopped by the shutdown; its work item stays queued");
        return Ok(());
    }

    c.updated_unix = now_unix();
    let made = match result {
        Ok(converted) => {
            c.state = ConversionState::Done;
            c.env_digest = Some(converted.env);
            converted.envelope
        }
        Err(e) => {
            metrics::counter!(CONVERSIONS_FAILED).increment(1);
            tracing::warn!(%image, error = %format!("{e:#}"), "conversion failed");
            c.state = ConversionState::Failed;
            c.error = Some(format!("{e:#}"));
            None
        }
    };
    let kept = reg.record_conversion(image, &c).await?;
    reg.store
        .delete_record(&RecordKey::conversion_work(image))
        .await?;
    match (&kept.state, &kept.env_digest) {
        (ConversionState::Done, Some(env)) => {
            reg.index.finish_conversion(image, env, &kept)?;
            tracing::info!(%image, %env, "conversion done");
            // The env's summary for the catalog pages and the totals (derived: a failure
            // here is retried by the next view or restart), from the envelope this
            // conversion made when it is the one recorded.
            let summarized = match made.as_ref().filter(|m| m.env_digest.to_string() == *env) {
                Some(envelope) => crate::envs::info_of(reg, env, envelope).await,
                None => crate::envs::info(reg, env).await,
            };
            if let Err(e) = summarized {
                tracing::warn!(%env, error = %e, "summarizing the new env");
            }
        }
        _ => reg.index.put_conversion(image, &kept)?,
    }
    Ok(())
}

/// Renews this replica's lease on `image`'s work item every third of a lease, until
/// aborted or until the item is no longer this replica's.
async fn renew(reg: Arc<Registry>, image: Digest, mut item: WorkItem, mut version: Version) {
    let lease = reg.config.conversion_lease_secs;
    let mut tick = tokio::time::interval(Duration::from_secs((lease / 3).max(1)));
    tick.tick().await; // the first tick is immediate
    loop {
        tick.tick().await;
        item.lease_until_unix = now_unix() + lease;
        match reg.put_conversion_work(&image, &item, Some(&version)).await {
            Ok(Some(v)) => version = v,
            Ok(None) => {
                tracing::warn!(%image, "lost the lease on a running conversion (another replica took it over)");
                return;
            }
            // A store that does not answer for a while: try again next tick.
            Err(e) => tracing::warn!(%image, error = %e, "renewing a conversion lease"),
        }
    }
}
