//! `--set section.key=value`: overrides of any key of the cluster file, type-checked against
//! the full configuration (defaults included), so `--set transport.cwnd_bytes=lots` fails
//! with a message naming the key and the expected type instead of a late parse error.

/// Applies one `PATH=VALUE` to `doc`. PATH is dotted; a numeric segment indexes an array
/// (`tables.0.dim`). VALUE is a TOML value (`65536`, `true`, `"x"`, `[1, 2]`); anything that
/// does not parse as one is taken as a string (`--set launch.mode=netns`).
pub fn apply(doc: &mut toml::Table, spec: &str) -> Result<(), String> {
    let (path, raw) =
        spec.split_once('=').ok_or_else(|| format!("--set {spec}: expected KEY=VALUE"))?;
    let path = path.trim();
    let segs: Vec<&str> = path.split('.').collect();
    if segs.len() < 2 || segs.iter().any(|s| s.is_empty()) {
        return Err(format!("--set {spec}: KEY must be section.key (e.g. transport.cwnd_bytes)"));
    }
    let value = parse_value(raw.trim());
    let (last, parents) = segs.split_last().ok_or_else(|| format!("--set {spec}: empty key"))?;
    let mut cur = toml::Value::Table(std::mem::take(doc));
    let result = set_in(&mut cur, parents, last, value, path);
    if let toml::Value::Table(t) = cur {
        *doc = t;
    }
    result.map_err(|m| format!("--set {spec}: {m}"))
}

fn parse_value(raw: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    }
}

fn set_in(
    cur: &mut toml::Value,
    parents: &[&str],
    last: &str,
    value: toml::Value,
    path: &str,
) -> Result<(), String> {
    let mut node = cur;
    for (i, seg) in parents.iter().enumerate() {
        let here = parents[..=i].join(".");
        node = match node {
            toml::Value::Table(t) => {
                t.entry(seg.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()))
            }
            toml::Value::Array(a) => {
                let idx: usize =
                    seg.parse().map_err(|_| format!("{here}: index {seg:?} is not a number"))?;
                let len = a.len();
                a.get_mut(idx).ok_or_else(|| format!("{here}: index {idx} ≥ length {len}"))?
            }
            other => return Err(format!("{here}: is a {}, not a section", other.type_str())),
        };
    }
    match node {
        toml::Value::Table(t) => {
            let v = match t.get(last) {
                Some(old) => coerce(old, value, path)?,
                None => value, // unknown keys are caught by the config's deny_unknown_fields
            };
            t.insert(last.to_string(), v);
            Ok(())
        }
        toml::Value::Array(a) => {
            let idx: usize =
                last.parse().map_err(|_| format!("{path}: index {last:?} is not a number"))?;
            let len = a.len();
            let slot =
                a.get_mut(idx).ok_or_else(|| format!("{path}: index {idx} ≥ length {len}"))?;
            *slot = coerce(slot, value, path)?;
            Ok(())
        }
        other => Err(format!("{path}: parent is a {}, not a section", other.type_str())),
    }
}

/// `new` converted to the type of `old`, or an error naming both.
fn coerce(old: &toml::Value, new: toml::Value, path: &str) -> Result<toml::Value, String> {
    use toml::Value as V;
    match (old, new) {
        (V::Float(_), V::Integer(i)) => Ok(V::Float(i as f64)),
        // A number where the file has a string: the string spelling (`--set cluster.name=7`).
        (V::String(_), V::Integer(i)) => Ok(V::String(i.to_string())),
        (V::String(_), V::Float(f)) => Ok(V::String(f.to_string())),
        (V::String(_), V::Boolean(b)) => Ok(V::String(b.to_string())),
        (o, n) if std::mem::discriminant(o) == std::mem::discriminant(&n) => Ok(n),
        (o, n) => Err(format!(
            "{path} expects {} (currently {o}), got {} {n}",
            article(o.type_str()),
            article(n.type_str())
        )),
    }
}

fn article(t: &str) -> String {
    let a = if t.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" };
    format!("{a} {t}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> toml::Table {
        toml::from_str(
            "[transport]\ncwnd_bytes = 0\n[rpc]\nretry_probability = 0.5\n[launch]\nmode = \"loopback\"\nphases = [\"inference\"]\n[[tables]]\nname = \"user\"\ndim = 16\n",
        )
        .unwrap()
    }

    #[test]
    fn sets_typed_values() {
        let mut d = doc();
        apply(&mut d, "transport.cwnd_bytes=65536").unwrap();
        apply(&mut d, "rpc.retry_probability=1").unwrap();
        apply(&mut d, "launch.mode=netns").unwrap();
        apply(&mut d, "launch.phases=[]").unwrap();
        apply(&mut d, "tables.0.dim=32").unwrap();
        apply(&mut d, "ranker.models=3").unwrap();
        assert_eq!(d["transport"]["cwnd_bytes"].as_integer(), Some(65536));
        assert_eq!(d["rpc"]["retry_probability"].as_float(), Some(1.0));
        assert_eq!(d["launch"]["mode"].as_str(), Some("netns"));
        assert_eq!(d["launch"]["phases"].as_array().map(|a| a.len()), Some(0));
        assert_eq!(d["tables"][0]["dim"].as_integer(), Some(32));
        assert_eq!(d["ranker"]["models"].as_integer(), Some(3));
    }

    #[test]
    fn type_errors_name_the_key_and_types() {
        let mut d = doc();
        let e = apply(&mut d, "transport.cwnd_bytes=lots").unwrap_err();
        assert!(
            e.contains("transport.cwnd_bytes expects an integer") && e.contains("string"),
            "{e}"
        );
        let e = apply(&mut d, "launch.phases=inference").unwrap_err();
        assert!(e.contains("expects an array"), "{e}");
        assert!(apply(&mut d, "tables.5.dim=3").unwrap_err().contains("index 5"));
        assert!(apply(&mut d, "cwnd_bytes=3").unwrap_err().contains("section.key"));
        assert!(apply(&mut d, "transport.cwnd_bytes").unwrap_err().contains("KEY=VALUE"));
        // A failed set leaves the document as it was.
        assert_eq!(d["transport"]["cwnd_bytes"].as_integer(), Some(0));
    }
}
