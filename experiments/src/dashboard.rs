//! Checks a Grafana dashboard against what a running cluster exports: every panel query
//! must name at least one bex metric, every metric it names must be among the series
//! scraped from the cluster's processes (`bex-cluster` keeps them in `OUT/metrics/*.prom`),
//! and every `label="value"` matcher must select a series that exists. A renamed metric,
//! a label typo or a panel that can never show data fails the check.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// Metric names bex exports start with one of these (`process_*` for the Prometheus
/// client convention); anything else in a query is a function, keyword or label.
const PREFIXES: &[&str] = &["bex_", "process_"];

/// The series of a scrape: name → every label set seen (`label=value` pairs).
#[derive(Debug, Default)]
pub struct Exported {
    series: BTreeMap<String, Vec<BTreeMap<String, String>>>,
}

impl Exported {
    /// Adds a scrape in the Prometheus text format.
    pub fn add_scrape(&mut self, text: &str) {
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = &line[..end];
            let labels = match line[end..].strip_prefix('{') {
                Some(rest) => parse_labels(rest.split('}').next().unwrap_or("")),
                None => BTreeMap::new(),
            };
            self.series.entry(name.to_string()).or_default().push(labels);
        }
    }

    /// How many metric names it holds.
    pub fn names(&self) -> usize {
        self.series.len()
    }
}

/// `a="x",b="y"` (values without escaped quotes, as bex writes them).
fn parse_labels(s: &str) -> BTreeMap<String, String> {
    s.split("\",")
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.trim().to_string(), v.trim().trim_matches('"').to_string()))
        })
        .collect()
}

/// One query of one panel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// The panel's title.
    pub panel: String,
    /// The PromQL.
    pub expr: String,
}

/// Every panel query of a dashboard (panels nested in rows included).
pub fn queries(dashboard: &Value) -> Vec<Query> {
    fn walk(panels: &Value, out: &mut Vec<Query>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("(untitled)");
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str() {
                    out.push(Query { panel: title.to_string(), expr: expr.to_string() });
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// A metric named in a query, with its equality matchers (`{a="x"}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// The metric.
    pub name: String,
    /// `label = "value"` matchers (other matcher kinds are not checked).
    pub equals: Vec<(String, String)>,
}

/// The bex metrics a PromQL expression selects.
pub fn selectors(expr: &str) -> Vec<Selector> {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            // Strings and label matchers are not metric names.
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += 1 + usize::from(b[i] == b'\\');
                }
                i += 1;
            }
            b'{' => i += expr[i..].find('}').map_or(b.len(), |e| e + 1),
            c if ident(c) && !c.is_ascii_digit() => {
                let start = i;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                let name = &expr[start..i];
                if !PREFIXES.iter().any(|p| name.starts_with(p)) {
                    continue;
                }
                let equals = match expr[i..].strip_prefix('{') {
                    Some(rest) => {
                        let body = rest.split('}').next().unwrap_or("");
                        body.split(',')
                            .filter(|m| !m.contains("!=") && !m.contains("=~"))
                            .filter_map(|m| {
                                let (k, v) = m.split_once('=')?;
                                Some((k.trim().to_string(), v.trim().trim_matches('"').to_string()))
                            })
                            .collect()
                    }
                    None => Vec::new(),
                };
                out.push(Selector { name: name.to_string(), equals });
            }
            _ => i += 1,
        }
    }
    out
}

/// Every problem of `dashboard` against `exported`; empty when every query can show data.
pub fn check(dashboard: &Value, exported: &Exported) -> Vec<String> {
    let mut problems = Vec::new();
    let qs = queries(dashboard);
    if qs.is_empty() {
        problems.push("the dashboard has no panel queries".into());
    }
    let mut missing = BTreeSet::new();
    for q in &qs {
        let sels = selectors(&q.expr);
        if sels.is_empty() {
            problems.push(format!("panel {:?}: no bex metric in {:?}", q.panel, q.expr));
        }
        for s in sels {
            let Some(label_sets) = exported.series.get(&s.name) else {
                if missing.insert(s.name.clone()) {
                    problems.push(format!("panel {:?}: {} is not exported", q.panel, s.name));
                }
                continue;
            };
            let selects = label_sets
                .iter()
                .any(|ls| s.equals.iter().all(|(k, v)| ls.get(k).is_some_and(|x| x == v)));
            if !selects {
                problems.push(format!(
                    "panel {:?}: no series {}{{{}}}",
                    q.panel,
                    s.name,
                    s.equals
                        .iter()
                        .map(|(k, v)| format!("{k}=\"{v}\""))
                        .collect::<Vec<_>>()
                        .join(",")
                ));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SCRAPE: &str = "\
# HELP bex_ps_requests_total Requests by op
# TYPE bex_ps_requests_total counter
bex_ps_requests_total{op=\"fetch\"} 3
bex_ps_request_duration_seconds_bucket{op=\"fetch\",le=\"0.001\"} 2
bex_transport_engines{transport=\"rdma\"} 4
process_cpu_seconds_total 1.5
";

    fn exported() -> Exported {
        let mut e = Exported::default();
        e.add_scrape(SCRAPE);
        e
    }

    #[test]
    fn finds_metrics_but_not_functions_labels_or_strings() {
        let s = selectors(
            "histogram_quantile(0.99, sum by (le, op) (rate(bex_ps_request_duration_seconds_bucket{op=\"fetch\", le!=\"bex_x\"}[$__rate_interval]))) / process_cpu_seconds_total",
        );
        assert_eq!(
            s,
            vec![
                Selector {
                    name: "bex_ps_request_duration_seconds_bucket".into(),
                    equals: vec![("op".into(), "fetch".into())]
                },
                Selector { name: "process_cpu_seconds_total".into(), equals: vec![] },
            ]
        );
    }

    #[test]
    fn a_good_dashboard_passes_and_each_kind_of_mistake_is_named() {
        let panel = |title: &str, expr: &str| json!({"title": title, "targets": [{"expr": expr}]});
        let good = json!({"panels": [
            {"type": "row", "title": "r", "panels": [panel("a", "rate(bex_ps_requests_total[1m])")]},
            panel("b", "bex_transport_engines{transport=\"rdma\"}"),
        ]});
        assert_eq!(check(&good, &exported()), Vec::<String>::new());

        let bad = json!({"panels": [
            panel("renamed", "rate(bex_ps_request_total[1m])"),
            panel("typo", "bex_transport_engines{transport=\"rmda\"}"),
            panel("none", "up"),
        ]});
        let p = check(&bad, &exported());
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p[0].contains("bex_ps_request_total is not exported"), "{p:?}");
        assert!(p[1].contains("transport=\"rmda\""), "{p:?}");
        assert!(p[2].contains("no bex metric"), "{p:?}");
        assert!(!check(&json!({}), &exported()).is_empty(), "an empty dashboard fails");
    }
}
