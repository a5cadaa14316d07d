//! End to end, in process: a `HashMap` stands in for the PS's embedding table (rows created on
//! first lookup, Adagrad applied from the summed row gradients), the model trains on the
//! synthetic clicks, and the held-out AUC must rise from chance while the training loss falls.

use std::collections::HashMap;

use bex_model::{auc, log_loss, ClicksConfig, Model, ModelConfig, Sample, SyntheticClicks};

const DIM: usize = 8;
const SLOTS: usize = 4;

/// The PS stand-in: rows initialized deterministically per key, updated by Adagrad.
struct Table {
    rows: HashMap<u64, (Vec<f32>, Vec<f32>)>, // (row, Adagrad accumulator)
    lr: f32,
}

impl Table {
    fn init(key: u64) -> Vec<f32> {
        // Small deterministic values in [-0.05, 0.05) from a hash of the key.
        (0..DIM as u64)
            .map(|j| {
                let mut z = key.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    ^ (j + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z ^= z >> 29;
                z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 32;
                ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            })
            .collect()
    }

    /// The rows of a batch, laid out as the model wants them (pull).
    fn gather(&mut self, batch: &[Sample]) -> Vec<f32> {
        let mut out = Vec::with_capacity(batch.len() * SLOTS * DIM);
        for s in batch {
            for &k in &s.keys {
                let (row, _) =
                    self.rows.entry(k).or_insert_with(|| (Self::init(k), vec![0.0; DIM]));
                out.extend_from_slice(row);
            }
        }
        out
    }

    /// Read-only lookup for evaluation (unseen keys get their initial row, not stored).
    fn lookup(&self, batch: &[Sample]) -> Vec<f32> {
        let mut out = Vec::with_capacity(batch.len() * SLOTS * DIM);
        for s in batch {
            for &k in &s.keys {
                match self.rows.get(&k) {
                    Some((row, _)) => out.extend_from_slice(row),
                    None => out.extend(Self::init(k)),
                }
            }
        }
        out
    }

    /// Sum the per-(sample, slot) gradients per key, then one Adagrad update per key (push).
    fn push(&mut self, batch: &[Sample], row_grads: &[f32]) {
        let mut summed: HashMap<u64, Vec<f32>> = HashMap::new();
        for (b, s) in batch.iter().enumerate() {
            for (slot, &k) in s.keys.iter().enumerate() {
                let g = &row_grads[(b * SLOTS + slot) * DIM..][..DIM];
                let acc = summed.entry(k).or_insert_with(|| vec![0.0; DIM]);
                acc.iter_mut().zip(g).for_each(|(a, g)| *a += g);
            }
        }
        for (k, g) in summed {
            let (row, h) = self.rows.get_mut(&k).expect("pushed key was pulled");
            for i in 0..DIM {
                h[i] += g[i] * g[i];
                row[i] -= self.lr * g[i] / (h[i].sqrt() + 1e-8);
            }
        }
    }
}

fn evaluate(model: &Model, table: &Table, held_out: &[Sample]) -> (f64, f64) {
    let logits = model.predict(&table.lookup(held_out));
    let labels: Vec<f32> = held_out.iter().map(|s| s.label).collect();
    (auc(&logits, &labels).expect("both classes"), log_loss(&logits, &labels))
}

#[test]
fn learns_the_hidden_model() {
    let data = SyntheticClicks::new(ClicksConfig { slots: SLOTS, ..ClicksConfig::default() });
    let mut model = Model::new(ModelConfig { slots: SLOTS, dim: DIM, ..ModelConfig::default() });
    let mut table = Table { rows: HashMap::new(), lr: 0.05 };
    let held_out: Vec<Sample> = data.held_out().take(5000).collect();
    let held_labels: Vec<f32> = held_out.iter().map(|s| s.label).collect();
    let click_rate = held_labels.iter().sum::<f32>() / held_labels.len() as f32;
    // What an oracle knowing the hidden model scores on the same samples.
    let oracle: Vec<f32> = held_out.iter().map(|s| data.hidden_score(&s.keys) as f32).collect();
    let oracle_auc = auc(&oracle, &held_labels).unwrap();

    let (auc0, loss0) = evaluate(&model, &table, &held_out);
    let (batch, steps) = (64, 2500);
    let mut train = data.train();
    let mut window = Vec::new(); // training losses of the last 100 steps
    let mut first_window = None;
    for step in 0..steps {
        let samples: Vec<Sample> = train.by_ref().take(batch).collect();
        let labels: Vec<f32> = samples.iter().map(|s| s.label).collect();
        let rows = table.gather(&samples);
        let out = model.train_step(&rows, &labels);
        table.push(&samples, &out.row_grads);
        window.push(out.loss);
        if window.len() == 100 {
            let mean = window.iter().sum::<f32>() / 100.0;
            if first_window.is_none() {
                first_window = Some(mean);
            }
            if step + 1 == steps {
                let (auc1, loss1) = evaluate(&model, &table, &held_out);
                let first = first_window.unwrap();
                println!(
                    "click rate {click_rate:.3}, oracle AUC {oracle_auc:.4}; held-out AUC \
                     {auc0:.4} → {auc1:.4}, log-loss {loss0:.4} → {loss1:.4}; training loss \
                     (100-step mean) {first:.4} → {mean:.4}; {} keys",
                    table.rows.len()
                );
                assert!((auc0 - 0.5).abs() < 0.1, "untrained AUC {auc0}");
                assert!(auc1 >= 0.75, "held-out AUC {auc1} < 0.75");
                assert!(loss1 < loss0, "held-out log-loss {loss0} → {loss1}");
                assert!(mean < first * 0.9, "training loss {first} → {mean}");
            }
            window.clear();
        }
    }
}
