//! The paper's reported numbers (000, §8), to print next to ours. Production scale (hundreds of
//! servers, 25 Gb/s NICs) is not reproducible here; the *ratios* are what we compare.

/// Table 5: CPU usage during peak inference, % of the machine: (RDMA, TCP).
pub const CPU_TOTAL: (f64, f64) = (51.31, 57.45);
/// Table 5: software interrupts.
pub const CPU_SOFTIRQ: (f64, f64) = (0.16, 1.70);
/// Table 5: system.
pub const CPU_SYSTEM: (f64, f64) = (4.18, 7.08);
/// Table 5: user.
pub const CPU_USER: (f64, f64) = (47.0, 48.7);
/// Table 6: PS Pull latency at the inference peak, ms: (RDMA, TCP).
pub const PULL_MEAN_MS: (f64, f64) = (8.1, 12.6);
/// Table 6: P99.
pub const PULL_P99_MS: (f64, f64) = (35.5, 63.1);
/// Table 7: busiest trainers' Fetch P99, ms: (TCP, RDMA HW only, RDMA HW + SW window).
pub const TRAIN_FETCH_P99_MS: (f64, f64, f64) = (650.0, 1040.0, 338.0);
/// Table 7: Push P99, ms.
pub const TRAIN_PUSH_P99_MS: (f64, f64, f64) = (1030.0, 1120.0, 268.0);
/// Table 7: loss indicator, as text.
pub const TRAIN_LOSS: (&str, &str, &str) = ("1%–4% loss", "3K NAKs per 30 s", "0");
