//! Medians and ratios: machines are noisy, so experiments repeat runs and report medians.

/// The median of `v` (mean of the middle two for an even count); `None` when empty or when a
/// value is not a number.
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() || v.iter().any(|x| x.is_nan()) {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 })
}

/// `a / b`, `None` when `b` is not positive.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite()).then(|| a / b)
}

/// A ratio as `0.62×`, or `n/a`.
pub fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".into(), |r| format!("{r:.2}×"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn ratios() {
        assert_eq!(ratio(1.0, 2.0), Some(0.5));
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(fmt_ratio(Some(0.617)), "0.62×");
        assert_eq!(fmt_ratio(None), "n/a");
    }
}
