//! The trainer's data and metrics for Python: the synthetic click task
//! ([`bex_model::SyntheticClicks`]), exact AUC, and the PS keys of dense parameters, so a
//! PyTorch model trains on the same samples, and keeps its dense weights under the same keys,
//! as the Rust `trainer` and `ranker`.

use std::sync::Arc;

use bex_model::{ClicksConfig, SyntheticClicks as Clicks};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;
use rand_chacha::ChaCha8Rng;

/// A seeded synthetic click dataset drawn from a hidden ground truth: per sample one
/// Zipf-distributed id per slot (key `slot << 48 | rank`) and a label ~ Bernoulli(sigmoid of
/// a hidden score with first-order and pairwise-embedding terms). The same parameters give
/// the same samples as the Rust trainer's `[data]` section.
#[pyclass(frozen, module = "bex")]
#[derive(Debug)]
pub struct SyntheticClicks {
    data: Arc<Clicks>,
}

#[pymethods]
impl SyntheticClicks {
    /// The dataset; the defaults are the trainer's (4 slots of 1000 ids, exponent 1.1; a
    /// click rate near 0.38 and a ground-truth AUC near 0.91).
    #[new]
    #[pyo3(signature = (slots=4, vocab=1000, zipf_exponent=1.1, hidden_dim=4, bias=-1.0,
                        first_order=1.2, interaction=0.6, seed=1))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments, one per field
    fn new(
        slots: usize,
        vocab: u64,
        zipf_exponent: f64,
        hidden_dim: usize,
        bias: f64,
        first_order: f64,
        interaction: f64,
        seed: u64,
    ) -> PyResult<Self> {
        // The Rust constructor asserts these; Python gets a ValueError instead.
        if !(1..=1 << 16).contains(&slots) {
            return Err(PyValueError::new_err(format!("slots {slots}: must be in 1..=65536")));
        }
        if vocab == 0 || vocab >= 1 << Clicks::RANK_BITS {
            return Err(PyValueError::new_err(format!("vocab {vocab}: must be in 1..2^48")));
        }
        if hidden_dim == 0 {
            return Err(PyValueError::new_err("hidden_dim must be positive"));
        }
        // The inverse-CDF table takes 8 bytes per id: an allocation that fails aborts the
        // interpreter, so it is tried here first (MemoryError, as numpy would).
        can_allocate::<f64>(usize::try_from(vocab).unwrap_or(usize::MAX), "vocab")?;
        if !(zipf_exponent.is_finite() && zipf_exponent >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "zipf_exponent {zipf_exponent}: must be finite and >= 0"
            )));
        }
        let cfg = ClicksConfig {
            slots,
            vocab,
            zipf_exponent,
            hidden_dim,
            bias,
            first_order,
            interaction,
            seed,
        };
        Ok(Self { data: Arc::new(Clicks::new(cfg)) })
    }

    /// Categorical slots per sample.
    #[getter]
    fn slots(&self) -> usize {
        self.data.config().slots
    }

    /// Distinct ids per slot.
    #[getter]
    fn vocab(&self) -> u64 {
        self.data.config().vocab
    }

    /// The training stream (the trainer's).
    fn train(&self) -> ClickStream {
        self.stream(Clicks::TRAIN_STREAM)
    }

    /// The held-out stream: the same ground truth, independent samples.
    fn held_out(&self) -> ClickStream {
        self.stream(Clicks::HELD_OUT_STREAM)
    }

    /// The stream of any seed; equal seeds give equal streams.
    fn stream(&self, seed: u64) -> ClickStream {
        ClickStream { data: Arc::clone(&self.data), rng: self.data.stream_rng(seed) }
    }

    /// The ground truth's click probability of each row of `keys` (uint64, shape
    /// `(n, slots)`): float64, shape `(n,)`. Its AUC is the best any model can reach.
    fn click_probability<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray2<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let keys = keys.as_array();
        if keys.ncols() != self.data.config().slots {
            return Err(PyValueError::new_err(format!(
                "keys have {} columns, the dataset {} slots",
                keys.ncols(),
                self.data.config().slots
            )));
        }
        let p: Vec<f64> =
            keys.rows().into_iter().map(|r| self.data.click_probability(&r.to_vec())).collect();
        Ok(PyArray1::from_vec(py, p))
    }
}

/// An endless stream of samples of a [`SyntheticClicks`] dataset.
#[pyclass(module = "bex")]
#[derive(Debug)]
pub struct ClickStream {
    data: Arc<Clicks>,
    rng: ChaCha8Rng,
}

#[pymethods]
impl ClickStream {
    /// The next `n` samples: `(keys, labels)`, keys uint64 of shape `(n, slots)` (column `s`
    /// holds slot `s`'s key), labels float32 of shape `(n,)` in {0, 1}.
    #[allow(clippy::type_complexity)] // the Python tuple it returns
    fn next_batch<'py>(
        &mut self,
        py: Python<'py>,
        n: usize,
    ) -> PyResult<(Bound<'py, PyArray2<u64>>, Bound<'py, PyArray1<f32>>)> {
        let slots = self.data.config().slots;
        can_allocate::<u64>(n.saturating_mul(slots), "n × slots")?;
        can_allocate::<f32>(n, "n")?;
        let mut keys = Vec::with_capacity(n * slots);
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            let s = self.data.sample(&mut self.rng);
            keys.extend_from_slice(&s.keys);
            labels.push(s.label);
        }
        let keys = PyArray1::from_vec(py, keys).reshape([n, slots])?;
        Ok((keys, PyArray1::from_vec(py, labels)))
    }
}

/// Exact ROC AUC of `scores` against `labels` (float32, a label is positive when > 0.5; tied
/// scores count one half); None when only one class is present.
#[pyfunction]
pub fn auc(
    scores: PyReadonlyArray1<'_, f32>,
    labels: PyReadonlyArray1<'_, f32>,
) -> PyResult<Option<f64>> {
    let (scores, labels) = (scores.as_array(), labels.as_array());
    if scores.len() != labels.len() {
        return Err(PyValueError::new_err(format!(
            "{} scores but {} labels",
            scores.len(),
            labels.len()
        )));
    }
    Ok(bex_model::auc(&scores.to_vec(), &labels.to_vec()))
}

/// The PS keys of model `model`'s `params` dense parameters kept as rows `row_dim` wide:
/// chunk `c` is key `1 << 63 | model << 32 | c` (the Rust trainer's and ranker's layout; never
/// a feature key of the synthetic task).
#[pyfunction]
pub fn dense_keys(
    py: Python<'_>,
    model: u32,
    params: usize,
    row_dim: usize,
) -> PyResult<Bound<'_, PyArray1<u64>>> {
    if row_dim == 0 {
        return Err(PyValueError::new_err("row_dim must be positive"));
    }
    Ok(PyArray1::from_vec(py, bex_model::dense_keys(model, params, row_dim)))
}

/// `MemoryError` when `n` values of `T` cannot be allocated now (a failed allocation in Rust
/// aborts the process; a Python caller expects an exception).
fn can_allocate<T>(n: usize, what: &str) -> PyResult<()> {
    let mut probe: Vec<T> = Vec::new();
    probe.try_reserve_exact(n).map_err(|e| {
        PyMemoryError::new_err(format!(
            "{what} = {n}: {} bytes cannot be allocated ({e})",
            n.saturating_mul(std::mem::size_of::<T>())
        ))
    })
}
