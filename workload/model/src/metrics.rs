//! Evaluation metrics: exact AUC and mean logistic loss.

/// The logistic function, computed without overflow for any finite `z`.
pub fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// Logistic loss of one logit `z` against a label `y` in {0, 1}, numerically stable:
/// `max(z, 0) − z·y + ln(1 + e^{−|z|})`.
pub(crate) fn logistic_loss(z: f32, y: f32) -> f32 {
    z.max(0.0) - z * y + (-z.abs()).exp().ln_1p()
}

/// Exact ROC AUC from the ranks of `scores` (the Mann–Whitney statistic): the probability that
/// a random positive scores above a random negative, tied pairs counting one half.
///
/// A label is positive when `> 0.5`. Scores are compared with `f32::total_cmp`. Returns `None`
/// when there is no positive or no negative (AUC is undefined).
///
/// # Panics
/// If `scores` and `labels` differ in length.
pub fn auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    assert_eq!(scores.len(), labels.len(), "auc: {} scores, {} labels", scores.len(), labels.len());
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_unstable_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut pos, mut rank_sum) = (0u64, 0f64);
    let mut i = 0;
    while i < order.len() {
        // The run of ties [i, j) shares the average of the 1-based ranks i+1 ..= j.
        let mut j = i + 1;
        while j < order.len() && scores[order[j]].total_cmp(&scores[order[i]]).is_eq() {
            j += 1;
        }
        let avg_rank = (i + 1 + j) as f64 / 2.0;
        for &k in &order[i..j] {
            if labels[k] > 0.5 {
                pos += 1;
                rank_sum += avg_rank;
            }
        }
        i = j;
    }
    let neg = scores.len() as u64 - pos;
    if pos == 0 || neg == 0 {
        return None;
    }
    let (p, n) = (pos as f64, neg as f64);
    Some((rank_sum - p * (p + 1.0) / 2.0) / (p * n))
}

/// Mean logistic loss (natural log) of `logits` against labels in {0, 1}; 0 for no samples.
///
/// # Panics
/// If `logits` and `labels` differ in length.
pub fn log_loss(logits: &[f32], labels: &[f32]) -> f64 {
    assert_eq!(
        logits.len(),
        labels.len(),
        "log_loss: {} logits, {} labels",
        logits.len(),
        labels.len()
    );
    if logits.is_empty() {
        return 0.0;
    }
    let sum: f64 = logits.iter().zip(labels).map(|(&z, &y)| f64::from(logistic_loss(z, y))).sum();
    sum / logits.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_known_cases() {
        // Perfect, inverted, all tied.
        assert_eq!(auc(&[0.1, 0.2, 0.8, 0.9], &[0.0, 0.0, 1.0, 1.0]), Some(1.0));
        assert_eq!(auc(&[0.9, 0.8, 0.2, 0.1], &[0.0, 0.0, 1.0, 1.0]), Some(0.0));
        assert_eq!(auc(&[0.5; 4], &[0.0, 1.0, 0.0, 1.0]), Some(0.5));
        // Pairs (pos, neg): pos {0.8, 0.4}, neg {0.6, 0.2}: 0.8>0.6, 0.8>0.2, 0.4<0.6, 0.4>0.2.
        assert_eq!(auc(&[0.8, 0.6, 0.4, 0.2], &[1.0, 0.0, 1.0, 0.0]), Some(0.75));
        // A tie across classes counts one half: pos {0.5, 0.9}, neg {0.5, 0.1} → (0.5+1+1+1)/4.
        assert_eq!(auc(&[0.5, 0.9, 0.5, 0.1], &[1.0, 1.0, 0.0, 0.0]), Some(0.875));
        // Undefined with one class only.
        assert_eq!(auc(&[0.1, 0.2], &[1.0, 1.0]), None);
        assert_eq!(auc(&[], &[]), None);
    }

    #[test]
    fn auc_matches_pairwise_count() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..50 {
            let n = rng.random_range(2..60);
            // Coarse scores so that ties are common.
            let s: Vec<f32> = (0..n).map(|_| rng.random_range(0..8) as f32 / 4.0).collect();
            let y: Vec<f32> = (0..n).map(|_| f32::from(rng.random_bool(0.4))).collect();
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for i in 0..n {
                for j in 0..n {
                    if y[i] > 0.5 && y[j] <= 0.5 {
                        den += 1.0;
                        num += match s[i].total_cmp(&s[j]) {
                            std::cmp::Ordering::Greater => 1.0,
                            std::cmp::Ordering::Equal => 0.5,
                            std::cmp::Ordering::Less => 0.0,
                        };
                    }
                }
            }
            let want = (den > 0.0).then(|| num / den);
            match (auc(&s, &y), want) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-12, "{a} vs {b}"),
                (a, b) => assert_eq!(a, b),
            }
        }
    }

    #[test]
    fn log_loss_known_values() {
        assert!((log_loss(&[0.0, 0.0], &[1.0, 0.0]) - std::f64::consts::LN_2).abs() < 1e-6);
        // Large logits neither overflow nor lose the loss.
        assert!((log_loss(&[100.0], &[0.0]) - 100.0).abs() < 1e-3);
        assert!(log_loss(&[100.0], &[1.0]) < 1e-6);
        assert!((log_loss(&[-3.0], &[1.0]) - (1.0 + 3f64.exp()).ln()).abs() < 1e-5);
        assert_eq!(log_loss(&[], &[]), 0.0);
        assert!((sigmoid(-100.0)).abs() < 1e-30 && (sigmoid(0.0) - 0.5).abs() < 1e-7);
    }
}
