//! Message-size accounting: the bytes of every per-shard sub-request and response a fetch or
//! push sends, from the wire format's lengths (what `PsClient` puts on the wire).

use bex_ps_proto::{shard_of, wire};
use bex_report::{MessageSizesReport, SizeSummary};
use hdrhistogram::Histogram;

/// Distinct keys per shard (index = shard), as `PsClient` splits them.
pub fn keys_per_shard(unique: &[u64], shards: u32) -> Vec<usize> {
    let mut n = vec![0usize; shards.max(1) as usize];
    for &k in unique {
        n[shard_of(k, shards.max(1)) as usize] += 1;
    }
    n
}

/// Byte histograms of one kind of message.
#[derive(Debug)]
pub struct SizeHist {
    h: Histogram<u64>,
}

impl Default for SizeHist {
    fn default() -> Self {
        // 1 B .. 1 GiB, 3 significant digits: the bounds are constants, valid by construction.
        SizeHist { h: Histogram::new_with_bounds(1, 1 << 30, 3).expect("valid histogram bounds") }
    }
}

impl SizeHist {
    /// Counts one message of `bytes`.
    pub fn record(&mut self, bytes: usize) {
        self.h.saturating_record(bytes.max(1) as u64);
    }

    /// The summary.
    pub fn summary(&self) -> SizeSummary {
        if self.h.is_empty() {
            return SizeSummary::default();
        }
        SizeSummary {
            count: self.h.len(),
            mean: self.h.mean(),
            p50: self.h.value_at_quantile(0.5),
            p99: self.h.value_at_quantile(0.99),
            max: self.h.max(),
        }
    }
}

/// The per-sub-request sizes of a run.
#[derive(Debug, Default)]
pub struct MessageSizes {
    /// Embedding fetch requests (header + 8 B per key).
    pub fetch_request: SizeHist,
    /// Embedding fetch responses (header + 4·dim B per key).
    pub fetch_response: SizeHist,
    /// Embedding push requests (header + (8 + 4·dim) B per key).
    pub push_request: SizeHist,
    /// Dense fetch responses.
    pub dense_fetch_response: SizeHist,
    /// Dense push requests.
    pub dense_push_request: SizeHist,
}

impl MessageSizes {
    /// Counts the sub-requests of fetching and pushing `unique` keys of `dim` over `shards`.
    pub fn record_embedding(&mut self, unique: &[u64], dim: usize, shards: u32) {
        for n in keys_per_shard(unique, shards).into_iter().filter(|&n| n > 0) {
            self.fetch_request.record(wire::fetch_request_len(n));
            self.fetch_response.record(wire::fetch_response_len(n, dim).unwrap_or(usize::MAX));
            self.push_request.record(wire::push_request_len(n, dim));
        }
    }

    /// The same for the dense rows (their keys are fixed; `fetch`/`push` say which happened).
    pub fn record_dense(&mut self, keys: &[u64], dim: usize, shards: u32, fetch: bool, push: bool) {
        for n in keys_per_shard(keys, shards).into_iter().filter(|&n| n > 0) {
            if fetch {
                self.dense_fetch_response
                    .record(wire::fetch_response_len(n, dim).unwrap_or(usize::MAX));
            }
            if push {
                self.dense_push_request.record(wire::push_request_len(n, dim));
            }
        }
    }

    /// The summaries.
    pub fn report(&self) -> MessageSizesReport {
        MessageSizesReport {
            fetch_request: self.fetch_request.summary(),
            fetch_response: self.fetch_response.summary(),
            push_request: self.push_request.summary(),
            dense_fetch_response: self.dense_fetch_response.summary(),
            dense_push_request: self.dense_push_request.summary(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_wire_format() {
        let keys: Vec<u64> = (0..100).collect();
        let per = keys_per_shard(&keys, 2);
        assert_eq!(per.iter().sum::<usize>(), 100);
        assert!(per.iter().all(|&n| n > 20), "the hash spreads keys: {per:?}");
        let mut m = MessageSizes::default();
        m.record_embedding(&keys, 16, 2);
        let r = m.report();
        assert_eq!(r.fetch_response.count, 2);
        // Sum over the two shards: headers + 100 rows of 64 B.
        let total = r.fetch_response.mean * 2.0;
        let want = (2 * wire::RESPONSE_HEADER_LEN + 100 * 64) as f64;
        assert!((total - want).abs() <= want * 0.002, "{total} vs {want}");
        let push_total = r.push_request.mean * 2.0;
        let want = (2 * wire::REQUEST_HEADER_LEN + 100 * (8 + 64)) as f64;
        assert!((push_total - want).abs() <= want * 0.002, "{push_total} vs {want}");
        // Each shard's request: a header and 8 B per key (means are exact: two samples).
        let fetch_total = r.fetch_request.mean * 2.0;
        let want = (2 * wire::REQUEST_HEADER_LEN + 100 * 8) as f64;
        assert!((fetch_total - want).abs() <= want * 0.002, "{fetch_total} vs {want}");
        let largest = wire::fetch_request_len(*per.iter().max().expect("two shards")) as u64;
        assert!(r.fetch_request.max.abs_diff(largest) <= largest / 500, "{r:?}");
        assert_eq!(r.dense_push_request.count, 0);
    }

    #[test]
    fn one_shard_gets_everything_and_empty_shards_send_nothing() {
        let mut m = MessageSizes::default();
        m.record_embedding(&[1, 2, 3], 4, 1);
        m.record_dense(&[5], 32, 8, true, false);
        let r = m.report();
        assert_eq!(r.push_request.count, 1);
        assert_eq!(r.push_request.max as usize, wire::push_request_len(3, 4));
        assert_eq!(r.dense_fetch_response.count, 1);
        assert_eq!(r.dense_push_request.count, 0);
        assert_eq!(SizeHist::default().summary(), SizeSummary::default());
    }
}
