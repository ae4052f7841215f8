//! The KV tier series of `/metrics`, per worker and tier (`host`, `disk`): blocks held and
//! their capacity, blocks offloaded and onboarded, lookups and hits below the pool, bytes and
//! seconds of copies each way, offloads skipped, checksum failures, disk write errors and
//! whether offload to disk stopped. Workers without tiers have none of these series.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use kvx_proto::{TierMetrics, WorkerId};

type WorkerLabel = [(&'static str, String); 1];
type TierLabel = [(&'static str, String); 2];
type CounterF = Counter<f64, AtomicU64>;

/// The tier families.
#[derive(Debug)]
pub(crate) struct TierFamilies {
    blocks: Family<TierLabel, Gauge>,
    capacity: Family<TierLabel, Gauge>,
    offloaded: Family<TierLabel, Counter>,
    onboarded: Family<TierLabel, Counter>,
    hits: Family<TierLabel, Counter>,
    lookups: Family<WorkerLabel, Counter>,
    offload_bytes: Family<TierLabel, Counter>,
    offload_seconds: Family<TierLabel, CounterF>,
    onboard_bytes: Family<TierLabel, Counter>,
    onboard_seconds: Family<TierLabel, CounterF>,
    skipped: Family<WorkerLabel, Counter>,
    checksum_failures: Family<WorkerLabel, Counter>,
    disk_errors: Family<WorkerLabel, Counter>,
    disk_stopped: Family<WorkerLabel, Gauge>,
}

impl TierFamilies {
    /// Registers the families in `r` (prefix `kvx_worker_kv_`).
    pub(crate) fn register(r: &mut Registry) -> Self {
        macro_rules! fam {
            ($name:literal, $help:literal, $l:ty, $t:ty) => {{
                let f = Family::<$l, $t>::default();
                r.register(concat!("worker_kv_", $name), $help, f.clone());
                f
            }};
        }
        TierFamilies {
            blocks: fam!("tier_blocks", "KV blocks held per tier", TierLabel, Gauge),
            capacity: fam!("tier_capacity_blocks", "KV blocks a tier holds", TierLabel, Gauge),
            offloaded: fam!("offload_blocks", "Blocks copied down into a tier", TierLabel, Counter),
            onboarded: fam!(
                "onboard_blocks",
                "Blocks loaded into the pool, by the tier they came from",
                TierLabel,
                Counter
            ),
            hits: fam!("tier_hits", "Prompt blocks found below the pool", TierLabel, Counter),
            lookups: fam!(
                "tier_lookups",
                "Prompt blocks looked up below the pool",
                WorkerLabel,
                Counter
            ),
            offload_bytes: fam!(
                "offload_bytes",
                "Bytes copied down into a tier",
                TierLabel,
                Counter
            ),
            offload_seconds: fam!(
                "offload_seconds",
                "Time of copies down into a tier",
                TierLabel,
                CounterF
            ),
            onboard_bytes: fam!(
                "onboard_bytes",
                "Bytes of loads into the pool, by the lowest tier read",
                TierLabel,
                Counter
            ),
            onboard_seconds: fam!(
                "onboard_seconds",
                "Time of loads into the pool, by the lowest tier read",
                TierLabel,
                CounterF
            ),
            skipped: fam!(
                "offload_skipped",
                "Registered blocks not copied down because copies lagged too far behind",
                WorkerLabel,
                Counter
            ),
            checksum_failures: fam!(
                "checksum_failures",
                "Blocks on disk that failed their checksum (computed instead)",
                WorkerLabel,
                Counter
            ),
            disk_errors: fam!(
                "disk_errors",
                "Failed writes to the disk tier",
                WorkerLabel,
                Counter
            ),
            disk_stopped: fam!(
                "disk_offload_stopped",
                "1 once offload to disk stopped after a failed write",
                WorkerLabel,
                Gauge
            ),
        }
    }

    /// Drops every worker's series (before setting those of the workers there now).
    pub(crate) fn clear(&self) {
        for f in
            [&self.offloaded, &self.onboarded, &self.hits, &self.offload_bytes, &self.onboard_bytes]
        {
            f.clear();
        }
        self.blocks.clear();
        self.capacity.clear();
        self.offload_seconds.clear();
        self.onboard_seconds.clear();
        for f in [&self.lookups, &self.skipped, &self.checksum_failures, &self.disk_errors] {
            f.clear();
        }
        self.disk_stopped.clear();
    }

    /// Sets worker `w`'s series from its counters (none for a worker without tiers).
    pub(crate) fn set(&self, w: WorkerId, t: &TierMetrics) {
        if t.host_capacity == 0 {
            return;
        }
        let l = [("worker", w.to_string())];
        let tl = |tier: &str| [("worker", w.to_string()), ("tier", tier.to_string())];
        let store = |c: &Counter, v: u64| c.inner().store(v, Ordering::Relaxed);
        let store_f = |c: &CounterF, v: f64| c.inner().store(v.to_bits(), Ordering::Relaxed);
        let host =
            [t.host_blocks, t.host_capacity, t.offloaded_host, t.onboarded_host, t.hits_host];
        let disk =
            [t.disk_blocks, t.disk_capacity, t.offloaded_disk, t.onboarded_disk, t.hits_disk];
        let host_io = (
            [t.offload_host_bytes, t.onboard_host_bytes],
            [t.offload_host_seconds, t.onboard_host_seconds],
        );
        let disk_io = (
            [t.offload_disk_bytes, t.onboard_disk_bytes],
            [t.offload_disk_seconds, t.onboard_disk_seconds],
        );
        for (tier, [blocks, cap, off, on, hits], ([off_b, on_b], [off_s, on_s])) in
            [("host", host, host_io), ("disk", disk, disk_io)]
        {
            if cap == 0 {
                continue;
            }
            let tl = tl(tier);
            self.blocks.get_or_create(&tl).set(blocks as i64);
            self.capacity.get_or_create(&tl).set(cap as i64);
            store(&self.offloaded.get_or_create(&tl), off);
            store(&self.onboarded.get_or_create(&tl), on);
            store(&self.hits.get_or_create(&tl), hits);
            store(&self.offload_bytes.get_or_create(&tl), off_b);
            store_f(&self.offload_seconds.get_or_create(&tl), off_s);
            store(&self.onboard_bytes.get_or_create(&tl), on_b);
            store_f(&self.onboard_seconds.get_or_create(&tl), on_s);
        }
        store(&self.lookups.get_or_create(&l), t.lookups);
        store(&self.skipped.get_or_create(&l), t.offload_skipped);
        store(&self.checksum_failures.get_or_create(&l), t.checksum_failures);
        store(&self.disk_errors.get_or_create(&l), t.disk_errors);
        self.disk_stopped.get_or_create(&l).set(i64::from(t.disk_stopped));
    }
}
