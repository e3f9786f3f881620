//! Prometheus metrics: the recorder, its `/metrics` rendering, and the metric names the
//! rest of the registry records into.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const REQUESTS: &str = "amber_http_requests_total";
pub const LATENCY: &str = "amber_http_request_duration_seconds";
pub const BYTES_IN: &str = "amber_http_body_bytes_in_total";
pub const BYTES_OUT: &str = "amber_http_body_bytes_out_total";
pub const UPLOADS_IN_FLIGHT: &str = "amber_uploads_in_flight";
pub const UPLOAD_SESSIONS_EXPIRED: &str = "amber_upload_sessions_expired_total";
/// Requests sent to S3, by operation (logical requests; the SDK's retries not counted).
pub const S3_REQUESTS: &str = "amber_s3_requests_total";
/// Object reads answered with a redirect to a presigned URL.
pub const REDIRECTS: &str = "amber_presigned_redirects_total";
/// Chunks a conversion wrote at its fast level that wait for `recompress` (the index's
/// count at start, then kept as chunks are noted and recompressed).
pub const CHUNKS_TO_RECOMPRESS: &str = "amber_chunks_to_recompress";

/// How often the histograms' recorded samples are drained into their buckets.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full(LATENCY.to_string()),
                    // Metadata reads take 0.05-0.3 ms in the handlers: buckets under a
                    // millisecond, or a regression there shows nowhere.
                    &[
                        0.0001, 0.00025, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
                        30.0, 120.0,
                    ],
                )
                .expect("bucket list is not empty")
                .build_recorder();
            let handle = recorder.handle();
            // A histogram keeps every sample it records until they are drained into its
            // buckets: by a render (a scrape of /metrics) or by upkeep. Without a scraper
            // that was 8 bytes more memory per request, for as long as the process ran
            // (about 576 MB an hour at 20,000 requests a second). Upkeep drains them
            // every few seconds whether or not anything scrapes.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(UPKEEP_EVERY);
                    upkeep.run_upkeep();
                })
                .expect("spawning the metrics upkeep thread");
            // Another recorder may be installed already (tests in one process); then the
            // handle still renders, just without that process's other metrics.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// The S3 requests this process sent so far, by operation, from `handle`'s rendering (for
/// commands that report what they cost, such as `reindex`).
pub fn s3_requests(handle: &PrometheusHandle) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for line in handle.render().lines() {
        let Some(rest) = line.strip_prefix(S3_REQUESTS) else {
            continue;
        };
        let op = rest
            .split_once("op=\"")
            .and_then(|(_, r)| r.split_once('"'))
            .map(|(op, _)| op.to_string());
        let n = rest.rsplit(' ').next().and_then(|n| n.parse::<f64>().ok());
        if let (Some(op), Some(n)) = (op, n) {
            out.push((op, n as u64));
        }
    }
    out.sort();
    out
}
