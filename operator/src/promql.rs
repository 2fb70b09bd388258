//! Tenant PromQL confined to the tenant's own series (pure), the way
//! prom-label-proxy enforces a label: every vector and matrix selector of a
//! query, in every subquery, function argument, binary operand and `or`
//! group, gets the enforced label matchers (`namespace="<fleet namespace>"`,
//! `fleet="<fleet>"`, and those the admin's policy adds for the namespace,
//! `queryMatchers`). A query that already pins one of those labels to the
//! same value keeps it; any other matcher on an enforced label (another
//! value, `!=`, a regex) is refused rather than rewritten, so a query never
//! silently means something else. Parsing is `promql-parser`'s.

use promql_parser::label::{MatchOp, Matcher, Matchers};
use promql_parser::parser::value::ValueType;
use promql_parser::parser::{self, Expr, VectorSelector};

/// Why a query cannot be confined (the caller names the spec field).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfineError {
    /// The query does not parse as PromQL.
    #[error("not valid PromQL: {0}")]
    Parse(String),
    /// A selector matches an enforced label other than by equality with its
    /// enforced value.
    #[error(
        "selector {selector} sets label {label:?} to something other than {value:?}; queries are confined to their fleet's own series"
    )]
    Conflict {
        /// The selector, as PromQL.
        selector: String,
        /// The enforced label.
        label: String,
        /// Its enforced value.
        value: String,
    },
    /// The query's answer is not an instant vector or a scalar (a range
    /// vector, a string): the operator reads one value per series.
    #[error("the query's answer is a {0}; an instant vector or a scalar is read")]
    NotInstant(String),
    /// A selector matches a label the admin's policy confines the
    /// namespace's queries to (`queryMatchers`) other than by equality with
    /// its value.
    #[error(
        "selector {selector} sets label {label:?} to something other than {value:?}; the operator's policy (queryMatchers) confines this namespace's queries to {label}={value:?}"
    )]
    Policy {
        /// The selector, as PromQL.
        selector: String,
        /// The policy's label.
        label: String,
        /// Its value.
        value: String,
    },
}

/// The labels every query is confined to by the fleet it belongs to.
const FLEET_LABELS: [&str; 2] = ["namespace", "fleet"];

/// A query template of `spec.metrics` for fleet `fleet` in `namespace`:
/// `{namespace}` and `{fleet}` substituted (both are DNS labels, so no
/// quoting is needed), then [`confine`]d to the fleet's own series (labels
/// `namespace` and `fleet`, as the scrape config sets them) and to the
/// admin's `policy` matchers for the namespace (label, value; the policy
/// never sets `namespace` or `fleet`). A conflict with a policy matcher is
/// [`ConfineError::Policy`]. The result is an instant vector: a query whose
/// answer is a scalar comes back wrapped in `vector()` (one series with no
/// labels, the same value), one whose answer is a range vector or a string
/// is [`ConfineError::NotInstant`].
pub fn render(
    template: &str,
    namespace: &str,
    fleet: &str,
    policy: &[(String, String)],
) -> Result<String, ConfineError> {
    let query = template
        .replace("{namespace}", namespace)
        .replace("{fleet}", fleet);
    let mut enforced = vec![(FLEET_LABELS[0], namespace), (FLEET_LABELS[1], fleet)];
    enforced.extend(
        policy
            .iter()
            .filter(|(label, _)| !FLEET_LABELS.contains(&label.as_str()))
            .map(|(l, v)| (l.as_str(), v.as_str())),
    );
    let expr = confined(&query, &enforced).map_err(|e| match e {
        ConfineError::Conflict {
            selector,
            label,
            value,
        } if !FLEET_LABELS.contains(&label.as_str()) => ConfineError::Policy {
            selector,
            label,
            value,
        },
        e => e,
    })?;
    match expr.value_type() {
        ValueType::Vector => Ok(expr.to_string()),
        ValueType::Scalar => Ok(format!("vector({expr})")),
        ValueType::Matrix => Err(ConfineError::NotInstant("range vector".into())),
        ValueType::String => Err(ConfineError::NotInstant("string".into())),
    }
}

/// `query` with every selector confined to the `enforced` (label, value)
/// pairs, as PromQL text. Errors: [`ConfineError`].
pub fn confine(query: &str, enforced: &[(&str, &str)]) -> Result<String, ConfineError> {
    Ok(confined(query, enforced)?.to_string())
}

/// [`confine`], as the parsed expression.
fn confined(query: &str, enforced: &[(&str, &str)]) -> Result<Expr, ConfineError> {
    let mut expr = parser::parse(query).map_err(ConfineError::Parse)?;
    walk(&mut expr, enforced)?;
    Ok(expr)
}

fn walk(e: &mut Expr, enforced: &[(&str, &str)]) -> Result<(), ConfineError> {
    match e {
        Expr::VectorSelector(vs) => enforce(vs, enforced),
        Expr::MatrixSelector(ms) => enforce(&mut ms.vs, enforced),
        Expr::Aggregate(a) => {
            walk(&mut a.expr, enforced)?;
            a.param.as_mut().map_or(Ok(()), |p| walk(p, enforced))
        }
        Expr::Unary(u) => walk(&mut u.expr, enforced),
        Expr::Binary(b) => {
            walk(&mut b.lhs, enforced)?;
            walk(&mut b.rhs, enforced)
        }
        Expr::Paren(p) => walk(&mut p.expr, enforced),
        Expr::Subquery(s) => walk(&mut s.expr, enforced),
        Expr::Call(c) => c.args.args.iter_mut().try_for_each(|a| walk(a, enforced)),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => Ok(()),
    }
}

/// Adds the enforced matchers to `vs` (to each `or` group when it has them).
fn enforce(vs: &mut VectorSelector, enforced: &[(&str, &str)]) -> Result<(), ConfineError> {
    let selector = Expr::VectorSelector(vs.clone()).to_string();
    let groups: Vec<&mut Vec<Matcher>> = if vs.matchers.or_matchers.is_empty() {
        vec![&mut vs.matchers.matchers]
    } else {
        vs.matchers.or_matchers.iter_mut().collect()
    };
    for group in groups {
        for &(label, value) in enforced {
            let mut pinned = false;
            for m in group.iter().filter(|m| m.name == label) {
                match &m.op {
                    MatchOp::Equal if m.value == value => pinned = true,
                    _ => {
                        return Err(ConfineError::Conflict {
                            selector: selector.clone(),
                            label: label.into(),
                            value: value.into(),
                        });
                    }
                }
            }
            if !pinned {
                group.push(Matcher::new(MatchOp::Equal, label, value));
            }
        }
    }
    // Keep the struct's invariant: plain matchers live in `matchers`.
    if !vs.matchers.or_matchers.is_empty() {
        vs.matchers =
            Matchers::empty().with_or_matchers(std::mem::take(&mut vs.matchers.or_matchers));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINE: &[(&str, &str)] = &[("namespace", "team-a"), ("fleet", "edge")];

    fn ok(q: &str) -> String {
        confine(q, MINE).unwrap_or_else(|e| panic!("{q}: {e}"))
    }

    /// Every selector in the confined query carries both enforced matchers:
    /// checked on the re-parsed result, not on the text.
    fn assert_confined(q: &str) {
        assert_confined_to(&ok(q), MINE);
    }

    /// Every selector in the PromQL `out` carries every `enforced` matcher.
    fn assert_confined_to(out: &str, enforced: &[(&str, &str)]) {
        let mut e = parser::parse(out).unwrap();
        fn check(e: &mut Expr, out: &str, enforced: &[(&str, &str)]) {
            let seen = |vs: &VectorSelector| {
                let groups: Vec<&Vec<Matcher>> = if vs.matchers.or_matchers.is_empty() {
                    vec![&vs.matchers.matchers]
                } else {
                    vs.matchers.or_matchers.iter().collect()
                };
                for g in groups {
                    for (l, v) in enforced {
                        assert!(
                            g.iter().any(|m| m.name == *l
                                && m.value == *v
                                && matches!(m.op, MatchOp::Equal)),
                            "{out}: a selector lacks {l}={v:?}"
                        );
                    }
                }
            };
            match e {
                Expr::VectorSelector(vs) => seen(vs),
                Expr::MatrixSelector(ms) => seen(&ms.vs),
                Expr::Aggregate(a) => {
                    check(&mut a.expr, out, enforced);
                    if let Some(p) = a.param.as_mut() {
                        check(p, out, enforced);
                    }
                }
                Expr::Unary(u) => check(&mut u.expr, out, enforced),
                Expr::Binary(b) => {
                    check(&mut b.lhs, out, enforced);
                    check(&mut b.rhs, out, enforced);
                }
                Expr::Paren(p) => check(&mut p.expr, out, enforced),
                Expr::Subquery(s) => check(&mut s.expr, out, enforced),
                Expr::Call(c) => c.args.args.iter_mut().for_each(|a| check(a, out, enforced)),
                _ => {}
            }
        }
        check(&mut e, out, enforced);
    }

    #[test]
    fn plain_and_default_queries_are_confined() {
        // Matchers print sorted by label name.
        assert_eq!(
            ok("c10m_connections"),
            r#"c10m_connections{fleet="edge",namespace="team-a"}"#
        );
        // The operator's default query already pins both: unchanged in meaning.
        assert_confined(r#"sum by (pod) (c10m_connections{namespace="team-a",fleet="edge"})"#);
        assert_confined(r#"up{namespace="team-a",fleet="edge"}"#);
    }

    #[test]
    fn tricky_queries_are_confined_everywhere() {
        for q in [
            // `or` and vector matching: both sides.
            r#"c10m_connections or other_tenant_metric"#,
            r#"a * on (pod) group_left b"#,
            r#"sum(a) / ignoring (x) sum(b)"#,
            // Subqueries, offsets, @.
            r#"max_over_time(rate(c10m_connections_accepted_total[1m])[10m:30s] offset 5m)"#,
            r#"c10m_connections offset 1h"#,
            r#"c10m_connections @ 1700000000"#,
            // label_replace cannot bring in another namespace's series: its
            // argument is confined before the labels are rewritten.
            r#"label_replace(kube_pod_info{namespace="team-a"}, "namespace", "team-a", "", "")"#,
            // Aggregation parameters and nested functions.
            r#"topk(3, sum by (pod) (c10m_connections))"#,
            r#"quantile(0.9, rate(x[5m]))"#,
            r#"absent(c10m_connections)"#,
            // A name-less selector.
            r#"{__name__=~"c10m_.*"}"#,
            r#"count({__name__=~".+"})"#,
        ] {
            assert_confined(q);
        }
    }

    #[test]
    fn selectors_reaching_for_other_series_are_refused() {
        for q in [
            r#"c10m_connections{namespace="team-b"}"#,
            r#"c10m_connections{namespace!="team-a"}"#,
            r#"c10m_connections{namespace=~".*"}"#,
            r#"c10m_connections{fleet=~"edge|core"}"#,
            r#"sum(a) or b{namespace="kube-system"}"#,
            r#"rate(x{namespace="other"}[5m])"#,
            r#"max_over_time(x{fleet="other"}[10m:1m])"#,
        ] {
            let err = confine(q, MINE).unwrap_err();
            assert!(matches!(err, ConfineError::Conflict { .. }), "{q}: {err:?}");
        }
    }

    #[test]
    fn templates_render_for_their_fleet() {
        assert_eq!(
            render(
                r#"sum by (pod) (c10m_connections{namespace="{namespace}",fleet="{fleet}"})"#,
                "team-a",
                "edge",
                &[]
            )
            .unwrap(),
            r#"sum by (pod) (c10m_connections{fleet="edge",namespace="team-a"})"#
        );
        assert!(render(r#"x{namespace="team-b"}"#, "team-a", "edge", &[]).is_err());
    }

    /// The policy's matchers for the namespace (`queryMatchers`).
    fn eu() -> Vec<(String, String)> {
        vec![
            ("cluster".into(), "eu-1".into()),
            ("tenant".into(), "a".into()),
        ]
    }

    const MINE_IN_EU: &[(&str, &str)] = &[
        ("namespace", "team-a"),
        ("fleet", "edge"),
        ("cluster", "eu-1"),
        ("tenant", "a"),
    ];

    #[test]
    fn policy_matchers_reach_every_selector() {
        assert_eq!(
            render("c10m_connections", "team-a", "edge", &eu()).unwrap(),
            r#"c10m_connections{cluster="eu-1",fleet="edge",namespace="team-a",tenant="a"}"#
        );
        for q in [
            r#"sum by (pod) (c10m_connections{namespace="{namespace}",fleet="{fleet}"})"#,
            // Already pinned to the policy's value: kept.
            r#"c10m_connections{cluster="eu-1"}"#,
            // or groups, in a selector and between vectors.
            r#"c10m_connections{pod="a" or pod="b"}"#,
            r#"c10m_connections or other_tenant_metric"#,
            // Vector matching, subqueries, offsets.
            r#"a * on (pod) group_left b"#,
            r#"max_over_time(rate(c10m_connections_accepted_total[1m])[10m:30s] offset 5m)"#,
            // Function arguments: label_replace cannot rename its way out.
            r#"label_replace(up, "cluster", "us-2", "", "")"#,
            r#"topk(3, sum by (pod) (c10m_connections))"#,
            r#"absent({__name__=~"c10m_.*"})"#,
        ] {
            let out = render(q, "team-a", "edge", &eu()).unwrap_or_else(|e| panic!("{q}: {e}"));
            assert_confined_to(&out, MINE_IN_EU);
        }
    }

    #[test]
    fn a_query_contradicting_the_policy_is_refused_naming_it() {
        for q in [
            r#"c10m_connections{cluster="us-2"}"#,
            r#"c10m_connections{cluster!="eu-1"}"#,
            r#"c10m_connections{cluster=~"eu-1|us-2"}"#,
            r#"c10m_connections{cluster="eu-1" or cluster="us-2"}"#,
            r#"sum(a) or b{tenant="b"}"#,
            r#"rate(x{cluster="us-2"}[5m])"#,
            r#"max_over_time(x{tenant=~".+"}[10m:1m])"#,
            r#"label_replace(x{cluster="us-2"}, "cluster", "eu-1", "", "")"#,
        ] {
            let err = render(q, "team-a", "edge", &eu()).unwrap_err();
            assert!(matches!(err, ConfineError::Policy { .. }), "{q}: {err:?}");
            let message = err.to_string();
            assert!(
                message.contains("the operator's policy (queryMatchers)"),
                "{message}"
            );
        }
        // The fleet's own labels are still the fleet's conflict.
        let err = render(r#"x{namespace="team-b"}"#, "team-a", "edge", &eu()).unwrap_err();
        assert!(matches!(err, ConfineError::Conflict { .. }), "{err:?}");
        // Without policy matchers, the label is the tenant's.
        render(r#"x{cluster="us-2"}"#, "team-a", "edge", &[]).unwrap();
    }

    #[test]
    fn numbers_and_strings_need_no_selector() {
        assert_eq!(ok("vector(1)"), "vector(1)");
        assert_eq!(ok("1 + 2"), "1 + 2");
    }

    #[test]
    fn a_rendered_query_answers_an_instant_vector() {
        // A scalar becomes one series without labels.
        assert_eq!(
            render("scalar(max(c10m_tcp_memory_bytes))", "team-a", "edge", &[]).unwrap(),
            r#"vector(scalar(max(c10m_tcp_memory_bytes{fleet="edge",namespace="team-a"})))"#
        );
        assert_eq!(render("42", "team-a", "edge", &[]).unwrap(), "vector(42)");
        // A range vector or a string has no one value per series.
        for (q, kind) in [
            ("c10m_connections[5m]", "range vector"),
            ("rate(c10m_connections[5m])[10m:1m]", "range vector"),
            (r#""c10m""#, "string"),
        ] {
            let err = render(q, "team-a", "edge", &[]).unwrap_err();
            assert_eq!(err, ConfineError::NotInstant(kind.into()), "{q}");
            assert!(err.to_string().contains(&format!("is a {kind};")), "{err}");
        }
    }

    #[test]
    fn garbage_is_refused() {
        assert!(matches!(confine("sum(", MINE), Err(ConfineError::Parse(_))));
        assert!(matches!(confine("", MINE), Err(ConfineError::Parse(_))));
    }
}
