//! Medians and ratios: machines are noisy, so experiments repeat runs and report medians.

pub use bex_bench::stats::median;

/// `a / b`, `None` when `b` is not a positive finite number or `a` is not finite (the
/// harness's ratio, for values that are always measured).
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    bex_bench::stats::ratio(Some(a), Some(b))
}

/// A ratio as `0.62×`, or `n/a`.
pub fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".into(), |r| format!("{r:.2}×"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios() {
        assert_eq!(ratio(1.0, 2.0), Some(0.5));
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(fmt_ratio(Some(0.617)), "0.62×");
        assert_eq!(fmt_ratio(None), "n/a");
    }
}
