//! A small Prometheus registry: counters and gauges (set, or computed at render time from
//! another component's counters) and fixed-bucket histograms, rendered in the text exposition format (version 0.0.4). No HTTP
//! here; the server serves [`Registry::render`] at `/metrics`.
//!
//! Handles are cheap clones of an `Arc` of atomics: record on the hot path without locks;
//! only registration and rendering take the registry's lock. Registering the same name and
//! labels again returns the same series (for a computed gauge it is an error instead: the
//! function cannot be shared).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Latency buckets in seconds: 10 µs to 10 s, roughly ×2.5 per step.
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Size buckets in bytes: 64 B to 64 MiB, ×4 per step.
pub const SIZE_BUCKETS_BYTES: &[f64] = &[
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
];

/// A registration that cannot be honoured.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The metric name is not `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    #[error("bad metric name {0:?}")]
    BadName(String),
    /// A label name is not `[a-zA-Z_][a-zA-Z0-9_]*` (or starts with `__`, or is `le` on a
    /// histogram), or repeats.
    #[error("bad label name {0:?}")]
    BadLabel(String),
    /// The name is already registered as another kind.
    #[error("{0} is already registered as another kind")]
    KindMismatch(String),
    /// Histogram bounds must be finite and strictly increasing (and the same on every
    /// series of one name).
    #[error("bad histogram buckets for {0}")]
    BadBuckets(String),
}

/// A monotonically increasing count.
#[derive(Clone, Debug, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (f64).
#[derive(Clone, Debug, Default)]
pub struct Gauge(Arc<AtomicU64>);

impl Gauge {
    /// Sets the value.
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }

    /// Adds `d` (may be negative).
    pub fn add(&self, d: f64) {
        let _ = self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
            Some((f64::from_bits(b) + d).to_bits())
        });
    }

    /// The value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

#[derive(Debug)]
struct HistInner {
    bounds: Box<[f64]>,
    /// One per bound plus +Inf; not cumulative.
    counts: Box<[AtomicU64]>,
    sum: AtomicU64,
}

/// Observations counted into fixed buckets (`le` upper bounds), with their sum.
#[derive(Clone, Debug)]
pub struct Histogram(Arc<HistInner>);

impl Histogram {
    fn new(bounds: &[f64]) -> Histogram {
        Histogram(Arc::new(HistInner {
            bounds: bounds.into(),
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }))
    }

    /// Records `v` (NaN is counted in +Inf and not summed).
    pub fn observe(&self, v: f64) {
        let h = &self.0;
        let i = h.bounds.partition_point(|&b| b < v);
        h.counts[i].fetch_add(1, Ordering::Relaxed);
        if !v.is_nan() {
            let _ = h.sum.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((f64::from_bits(b) + v).to_bits())
            });
        }
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        f64::from_bits(self.0.sum.load(Ordering::Relaxed))
    }
}

/// A value read at each render (a counter or a gauge, as its family says).
type Computed = Arc<dyn Fn() -> f64 + Send + Sync>;

enum Value {
    Counter(Counter),
    Gauge(Gauge),
    Computed(Computed),
    Histogram(Histogram),
}

/// A series handle that every registration of its name and labels shares.
trait Shared: Clone + Default {
    const KIND: Kind;
    fn of(v: &Value) -> Option<&Self>;
    fn into_value(self) -> Value;
}

/// `Shared` for the handle stored as `Value::$t`, of kind `Kind::$t`.
macro_rules! shared {
    ($t:ident) => {
        impl Shared for $t {
            const KIND: Kind = Kind::$t;
            fn of(v: &Value) -> Option<&Self> {
                if let Value::$t(m) = v {
                    Some(m)
                } else {
                    None
                }
            }
            fn into_value(self) -> Value {
                Value::$t(self)
            }
        }
    };
}
shared!(Counter);
shared!(Gauge);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

struct Series {
    labels: Vec<(String, String)>,
    value: Value,
}

struct Family {
    name: String,
    help: String,
    kind: Kind,
    series: Vec<Series>,
}

/// A set of metrics to render together.
#[derive(Default)]
pub struct Registry {
    families: Mutex<Vec<Family>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("families", &self.families.lock().len()).finish()
    }
}

fn valid_name(s: &str, colon: bool) -> bool {
    let mut b = s.bytes();
    let first_ok = |c: u8| c.is_ascii_alphabetic() || c == b'_' || (colon && c == b':');
    matches!(b.next(), Some(c) if first_ok(c))
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || (colon && c == b':'))
}

fn escape(s: &str, out: &mut String, quote: bool) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quote => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

fn fmt_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

fn write_labels(out: &mut String, labels: &[(String, String)], extra: Option<(&str, &str)>) {
    if labels.is_empty() && extra.is_none() {
        return;
    }
    out.push('{');
    let mut first = true;
    for (k, v) in labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).chain(extra) {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(k);
        out.push_str("=\"");
        escape(v, out, true);
        out.push('"');
    }
    out.push('}');
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    fn register<T>(
        &self,
        name: &str,
        help: &str,
        kind: Kind,
        labels: &[(&str, &str)],
        existing: impl FnOnce(&Value) -> Result<T, MetricsError>,
        make: impl FnOnce() -> (Value, T),
    ) -> Result<T, MetricsError> {
        if !valid_name(name, true) {
            return Err(MetricsError::BadName(name.into()));
        }
        let mut seen = std::collections::HashSet::new();
        for (k, _) in labels {
            let reserved = k.starts_with("__") || (kind == Kind::Histogram && *k == "le");
            if !valid_name(k, false) || reserved || !seen.insert(*k) {
                return Err(MetricsError::BadLabel((*k).into()));
            }
        }
        let labels: Vec<(String, String)> =
            labels.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect();
        let mut fams = self.families.lock();
        let fam = match fams.iter_mut().position(|f| f.name == name) {
            Some(i) if fams[i].kind != kind => return Err(MetricsError::KindMismatch(name.into())),
            Some(i) => &mut fams[i],
            None => {
                fams.push(Family {
                    name: name.into(),
                    help: help.into(),
                    kind,
                    series: Vec::new(),
                });
                let last = fams.len() - 1;
                &mut fams[last]
            }
        };
        if let Some(s) = fam.series.iter().find(|s| s.labels == labels) {
            return existing(&s.value);
        }
        let (value, handle) = make();
        fam.series.push(Series { labels, value });
        Ok(handle)
    }

    /// The counter `name{labels}`.
    pub fn counter(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Counter, MetricsError> {
        self.shared(name, help, labels)
    }

    /// The gauge `name{labels}`.
    pub fn gauge(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Gauge, MetricsError> {
        self.shared(name, help, labels)
    }

    /// A counter or gauge: registering `name{labels}` again returns the same series.
    fn shared<M: Shared>(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<M, MetricsError> {
        self.register(
            name,
            help,
            M::KIND,
            labels,
            |v| M::of(v).cloned().ok_or_else(|| MetricsError::KindMismatch(name.into())),
            || {
                let m = M::default();
                (m.clone().into_value(), m)
            },
        )
    }

    /// A gauge `name{labels}` whose value `f` computes at each render (rows stored,
    /// replication lag, registered bytes…). `f` runs under the registry lock: keep it short
    /// and do not touch the registry from it.
    pub fn gauge_fn(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        f: impl Fn() -> f64 + Send + Sync + 'static,
    ) -> Result<(), MetricsError> {
        self.computed(name, help, Kind::Gauge, labels, Arc::new(f))
    }

    /// A counter `name{labels}` whose value `f` reads at each render: for counts another
    /// component keeps (transport, NIC, RPC client), so the hot path pays nothing extra.
    /// `f` runs under the registry lock, as for [`Registry::gauge_fn`]; it must not
    /// decrease (NaN: unknown at this scrape).
    pub fn counter_fn(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        f: impl Fn() -> f64 + Send + Sync + 'static,
    ) -> Result<(), MetricsError> {
        self.computed(name, help, Kind::Counter, labels, Arc::new(f))
    }

    /// A computed series cannot be shared: registering one twice is an error.
    fn computed(
        &self,
        name: &str,
        help: &str,
        kind: Kind,
        labels: &[(&str, &str)],
        f: Computed,
    ) -> Result<(), MetricsError> {
        self.register(
            name,
            help,
            kind,
            labels,
            |_| Err(MetricsError::KindMismatch(name.into())),
            || (Value::Computed(f), ()),
        )
    }

    /// The histogram `name{labels}` with upper bounds `buckets` (finite, strictly
    /// increasing; +Inf is implicit).
    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        buckets: &[f64],
    ) -> Result<Histogram, MetricsError> {
        if buckets.iter().any(|b| !b.is_finite()) || buckets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(MetricsError::BadBuckets(name.into()));
        }
        self.register(
            name,
            help,
            Kind::Histogram,
            labels,
            |v| match v {
                Value::Histogram(h) if *h.0.bounds == *buckets => Ok(h.clone()),
                _ => Err(MetricsError::BadBuckets(name.into())),
            },
            || {
                let h = Histogram::new(buckets);
                (Value::Histogram(h.clone()), h)
            },
        )
    }

    /// Every metric in the Prometheus text format, families in registration order.
    pub fn render(&self) -> String {
        let fams = self.families.lock();
        let mut out = String::new();
        for f in fams.iter() {
            out.push_str("# HELP ");
            out.push_str(&f.name);
            out.push(' ');
            escape(&f.help, &mut out, false);
            out.push('\n');
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.name());
            for s in &f.series {
                match &s.value {
                    Value::Counter(c) => {
                        out.push_str(&f.name);
                        write_labels(&mut out, &s.labels, None);
                        let _ = writeln!(out, " {}", c.get());
                    }
                    Value::Gauge(g) => {
                        out.push_str(&f.name);
                        write_labels(&mut out, &s.labels, None);
                        let _ = writeln!(out, " {}", fmt_f64(g.get()));
                    }
                    Value::Computed(g) => {
                        out.push_str(&f.name);
                        write_labels(&mut out, &s.labels, None);
                        let _ = writeln!(out, " {}", fmt_f64(g()));
                    }
                    Value::Histogram(h) => {
                        let mut cum = 0u64;
                        let counts: Vec<u64> =
                            h.0.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
                        for (i, c) in counts.iter().enumerate() {
                            cum += c;
                            let le = h.0.bounds.get(i).map_or("+Inf".to_string(), |b| fmt_f64(*b));
                            out.push_str(&f.name);
                            out.push_str("_bucket");
                            write_labels(&mut out, &s.labels, Some(("le", &le)));
                            let _ = writeln!(out, " {cum}");
                        }
                        out.push_str(&f.name);
                        out.push_str("_sum");
                        write_labels(&mut out, &s.labels, None);
                        let _ = writeln!(out, " {}", fmt_f64(h.sum()));
                        out.push_str(&f.name);
                        out.push_str("_count");
                        write_labels(&mut out, &s.labels, None);
                        let _ = writeln!(out, " {cum}");
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_text_format() {
        let r = Registry::new();
        let c = r.counter("ps_requests_total", "Requests by op.", &[("op", "fetch")]).unwrap();
        let c2 = r.counter("ps_requests_total", "Requests by op.", &[("op", "push")]).unwrap();
        c.add(3);
        c2.inc();
        // Same name and labels: the same series.
        r.counter("ps_requests_total", "", &[("op", "fetch")]).unwrap().inc();
        let g = r.gauge("ps_replication_lag_batches", "Lag.", &[]).unwrap();
        g.set(2.0);
        g.add(-0.5);
        r.gauge_fn("ps_rows", "Rows.", &[("table", "a\"b\\c\nd")], || 7.0).unwrap();
        r.counter_fn("ps_packets_total", "Packets.", &[], || 9.0).unwrap();
        let h = r
            .histogram("ps_latency_seconds", "Latency.", &[("op", "fetch")], &[0.001, 0.01])
            .unwrap();
        h.observe(0.0005);
        h.observe(0.001); // le is inclusive
        h.observe(0.5);
        let text = r.render();
        let want = "\
# HELP ps_requests_total Requests by op.
# TYPE ps_requests_total counter
ps_requests_total{op=\"fetch\"} 4
ps_requests_total{op=\"push\"} 1
# HELP ps_replication_lag_batches Lag.
# TYPE ps_replication_lag_batches gauge
ps_replication_lag_batches 1.5
# HELP ps_rows Rows.
# TYPE ps_rows gauge
ps_rows{table=\"a\\\"b\\\\c\\nd\"} 7
# HELP ps_packets_total Packets.
# TYPE ps_packets_total counter
ps_packets_total 9
# HELP ps_latency_seconds Latency.
# TYPE ps_latency_seconds histogram
ps_latency_seconds_bucket{op=\"fetch\",le=\"0.001\"} 2
ps_latency_seconds_bucket{op=\"fetch\",le=\"0.01\"} 2
ps_latency_seconds_bucket{op=\"fetch\",le=\"+Inf\"} 3
ps_latency_seconds_sum{op=\"fetch\"} 0.5015
ps_latency_seconds_count{op=\"fetch\"} 3
";
        assert_eq!(text, want);
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn registration_errors() {
        let r = Registry::new();
        assert!(matches!(r.counter("1x", "", &[]), Err(MetricsError::BadName(_))));
        assert!(matches!(r.counter("x", "", &[("__a", "")]), Err(MetricsError::BadLabel(_))));
        assert!(matches!(
            r.counter("x", "", &[("a", ""), ("a", "")]),
            Err(MetricsError::BadLabel(_))
        ));
        assert!(matches!(
            r.histogram("h", "", &[("le", "")], &[1.0]),
            Err(MetricsError::BadLabel(_))
        ));
        r.counter("x", "", &[]).unwrap();
        assert!(matches!(r.gauge("x", "", &[]), Err(MetricsError::KindMismatch(_))));
        // A computed series cannot be shared: registering it twice is an error.
        r.counter_fn("y", "", &[], || 1.0).unwrap();
        assert!(matches!(r.counter_fn("y", "", &[], || 2.0), Err(MetricsError::KindMismatch(_))));
        assert!(matches!(r.counter("y", "", &[]), Err(MetricsError::KindMismatch(_))));
        assert!(matches!(r.histogram("h", "", &[], &[2.0, 1.0]), Err(MetricsError::BadBuckets(_))));
        assert!(matches!(
            r.histogram("h", "", &[], &[f64::INFINITY]),
            Err(MetricsError::BadBuckets(_))
        ));
        r.histogram("h", "", &[], LATENCY_BUCKETS_S).unwrap();
        assert!(matches!(
            r.histogram("h", "", &[], SIZE_BUCKETS_BYTES),
            Err(MetricsError::BadBuckets(_))
        ));
        r.histogram("h", "", &[], LATENCY_BUCKETS_S).unwrap();
    }

    #[test]
    fn counters_are_shared_across_threads() {
        let r = Registry::new();
        let c = r.counter("n_total", "", &[]).unwrap();
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || (0..10_000).for_each(|_| c.inc()))
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(c.get(), 40_000);
        assert!(r.render().contains("n_total 40000\n"));
    }
}
