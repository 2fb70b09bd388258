//! Objects parsed without their `metadata.managedFields`.
//!
//! The API server sends every object with its `managedFields`: per field
//! manager, a tree of the fields it set (`fieldsV1`), often half an object's
//! bytes. k8s-openapi parses each tree into a `serde_json::Value`, a map per
//! level, and the operator drops it unread (`controller::lean`). Building and
//! freeing those maps was 8.8 % of the operator's CPU over `make
//! bench-scale`'s ramp (perf, 299 Hz, 2026-12-06: 3.3 % in its watches, 1.6 %
//! in its lists, 2.3 % in its applies' answers). [`Unmanaged`] parses any
//! object with every `managedFields` entry skipped as the parser reads it
//! (serde's `IgnoredAny`: nothing allocated), so the objects come out as
//! `lean` would leave them. The key is skipped only in a map that is the
//! value of a `metadata` key (an object's, or a pod template's, which never
//! has one); a label or annotation of that name is kept.

use std::borrow::Cow;
use std::fmt;

use kube::Resource;
use serde::de::value::{BorrowedStrDeserializer, StringDeserializer};
use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use serde::{Deserialize, Serialize};

/// The key skipped in a [`METADATA`] map.
const SKIPPED: &str = "managedFields";

/// The key whose value may hold [`SKIPPED`].
const METADATA: &str = "metadata";

/// A `K` read with its `managedFields` skipped, never built: `K` as the API
/// sends it, `metadata.managedFields` `None`. An `Api<Unmanaged<K>>` reads,
/// lists, watches and applies `K`'s objects (same URLs; [`Resource`] is
/// `K`'s); `.0` is the object. Serializes as `K`.
#[derive(Clone, Debug, Serialize)]
#[serde(transparent)]
pub struct Unmanaged<K>(pub K);

impl<'de, K: Deserialize<'de>> Deserialize<'de> for Unmanaged<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        K::deserialize(Skipping(d, false)).map(Unmanaged)
    }
}

/// Implements [`Resource`] for a type that stands for the kind `$kind`
/// (its group, version, kind, plural, scope, and whether its requests ask
/// for metadata only, as `PartialObjectMeta`'s do): `[generics] Type =>
/// Kind, |o| metadata of o, mutable metadata of o`.
macro_rules! resource_as {
    ([$($generics:tt)*] $ty:ty => $kind:ty, |$o:ident| $meta:expr, $meta_mut:expr) => {
        impl<$($generics)*> ::kube::Resource for $ty {
            type DynamicType = ();
            type Scope = <$kind as ::kube::Resource>::Scope;

            fn kind(dt: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::kind(dt)
            }
            fn group(dt: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::group(dt)
            }
            fn version(dt: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::version(dt)
            }
            fn plural(dt: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::plural(dt)
            }
            fn metadata_api() -> bool {
                <$kind as ::kube::Resource>::metadata_api()
            }
            fn meta(&self) -> &::kube::api::ObjectMeta {
                let $o = self;
                $meta
            }
            fn meta_mut(&mut self) -> &mut ::kube::api::ObjectMeta {
                let $o = self;
                $meta_mut
            }
        }
    };
}
pub(crate) use resource_as;

resource_as!([K: Resource<DynamicType = ()>] Unmanaged<K> => K, |o| o.0.meta(), o.0.meta_mut());

/// The objects `api` lists under `lp`, each read without its
/// `managedFields`. Errors: the list request's.
pub async fn list<K>(
    api: &kube::Api<Unmanaged<K>>,
    lp: &kube::api::ListParams,
) -> kube::Result<Vec<K>>
where
    K: Resource<DynamicType = ()> + serde::de::DeserializeOwned + Clone + fmt::Debug,
{
    Ok(api.list(lp).await?.items.into_iter().map(|o| o.0).collect())
}

/// A watch's event of [`Unmanaged`] objects as the event of the objects.
pub fn event<K>(
    e: kube::runtime::watcher::Event<Unmanaged<K>>,
) -> kube::runtime::watcher::Event<K> {
    use kube::runtime::watcher::Event;
    match e {
        Event::Apply(o) => Event::Apply(o.0),
        Event::Delete(o) => Event::Delete(o.0),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(o.0),
        Event::InitDone => Event::InitDone,
    }
}

/// The deserializer `D`, with the [`SKIPPED`] entry of every map under a
/// [`METADATA`] key skipped: each visitor it calls is wrapped so that the
/// maps and sequences it hands on are wrapped too. `.1`: what `D` reads is
/// a [`METADATA`] key's value.
struct Skipping<D>(D, bool);

/// Forwards `deserialize_*` methods that take only a visitor.
macro_rules! forward {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
            self.0.$method(Wrapped(v, self.1))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Skipping<D> {
    type Error = D::Error;

    forward! {
        deserialize_any deserialize_bool deserialize_i8 deserialize_i16
        deserialize_i32 deserialize_i64 deserialize_i128 deserialize_u8
        deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
        deserialize_f32 deserialize_f64 deserialize_char deserialize_str
        deserialize_string deserialize_bytes deserialize_byte_buf
        deserialize_option deserialize_unit deserialize_seq deserialize_map
        deserialize_identifier deserialize_ignored_any
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_unit_struct(name, Wrapped(v, self.1))
    }
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_newtype_struct(name, Wrapped(v, self.1))
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, v: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple(len, Wrapped(v, self.1))
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0
            .deserialize_tuple_struct(name, len, Wrapped(v, self.1))
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_struct(name, fields, Wrapped(v, self.1))
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_enum(name, variants, Wrapped(v, self.1))
    }
    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// A visitor whose maps and sequences (and `Some`, newtype contents) are
/// read [`Skipping`]; `.1` as [`Skipping`]'s.
struct Wrapped<V>(V, bool);

/// Forwards `visit_*` methods that take one value.
macro_rules! visit {
    ($($method:ident($t:ty))*) => {$(
        fn $method<E: de::Error>(self, x: $t) -> Result<V::Value, E> {
            self.0.$method(x)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrapped<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.expecting(f)
    }

    visit! {
        visit_bool(bool) visit_i8(i8) visit_i16(i16) visit_i32(i32)
        visit_i64(i64) visit_i128(i128) visit_u8(u8) visit_u16(u16)
        visit_u32(u32) visit_u64(u64) visit_u128(u128) visit_f32(f32)
        visit_f64(f64) visit_char(char) visit_str(&str)
        visit_borrowed_str(&'de str) visit_string(String) visit_bytes(&[u8])
        visit_borrowed_bytes(&'de [u8]) visit_byte_buf(Vec<u8>)
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_none()
    }
    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_unit()
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.0.visit_some(Skipping(d, self.1))
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.0.visit_newtype_struct(Skipping(d, self.1))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.0.visit_seq(Seq(seq))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.0.visit_map(Map {
            map,
            metadata: self.1,
            value_is_metadata: false,
        })
    }
    // No kind the operator reads holds an object inside an enum (JSON has
    // none; k8s-openapi's are strings), so an enum's contents are read as
    // they are.
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.0.visit_enum(data)
    }
}

/// A seed that deserializes [`Skipping`]; `.1` as [`Skipping`]'s.
struct Seed<S>(S, bool);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<S> {
    type Value = S::Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Skipping(d, self.1))
    }
}

/// A sequence whose elements are read [`Skipping`].
struct Seq<A>(A);

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Seq<A> {
    type Error = A::Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(Seed(seed, false))
    }
    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

/// A map whose values are read [`Skipping`], and whose [`SKIPPED`] entry
/// is skipped when it is a [`METADATA`] key's value (`metadata`).
struct Map<A> {
    map: A,
    metadata: bool,
    /// The key last handed on was [`METADATA`].
    value_is_metadata: bool,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Map<A> {
    type Error = A::Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        while let Some(Key(key)) = self.map.next_key::<Key<'de>>()? {
            if self.metadata && key == SKIPPED {
                self.map.next_value::<IgnoredAny>()?;
                continue;
            }
            self.value_is_metadata = key == METADATA;
            return match key {
                Cow::Borrowed(k) => seed.deserialize(BorrowedStrDeserializer::new(k)),
                Cow::Owned(k) => seed.deserialize(StringDeserializer::new(k)),
            }
            .map(Some);
        }
        Ok(None)
    }
    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.map.next_value_seed(Seed(seed, self.value_is_metadata))
    }
    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint()
    }
}

/// A map key as the parser gives it: borrowed from the input where it has
/// no escapes (no allocation), else owned.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map key")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s)))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{Node, Pod, Service};
    use kube::core::PartialObjectMeta;
    use serde_json::json;

    /// What the API server sends: managed fields on the object, labels and
    /// annotations (one key with an escape, so the parser hands it over
    /// owned; one named like the skipped key, which is kept), a pod
    /// template with metadata of its own, and an `IntOrString` each way.
    fn deployment() -> serde_json::Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {
                "name": "f", "namespace": "ns", "uid": "u1", "resourceVersion": "7",
                "labels": {"app": "f", "a\"b": "x"},
                "annotations": {"managedFields": "a value is kept, only the key is skipped"},
                "managedFields": [
                    {"manager": "c10m-operator", "operation": "Apply", "apiVersion": "apps/v1",
                     "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:spec": {"f:template": {"f:spec": {"f:containers": {
                         "k:{\"name\":\"server\"}": {".": {}, "f:image": {}}}}}}}},
                    {"manager": "kube-controller-manager", "operation": "Update",
                     "subresource": "status", "fieldsV1": {"f:status": {"f:replicas": {}}}}
                ]
            },
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "f"}},
                "strategy": {"rollingUpdate": {"maxSurge": 2, "maxUnavailable": "0%"}},
                "template": {
                    "metadata": {"labels": {"app": "f"}},
                    "spec": {"containers": [{"name": "server", "image": "s:1",
                        "ports": [{"containerPort": 8080}],
                        "resources": {"limits": {"memory": "1Gi", "cpu": "500m"}}}]}
                }
            },
            "status": {"replicas": 3, "readyReplicas": 2,
                "conditions": [{"type": "Available", "status": "True"}]}
        })
    }

    /// `K` parsed whole, then its managed fields dropped: what `Unmanaged`
    /// must give without building them.
    fn dropped<K: Resource + serde::de::DeserializeOwned>(v: &serde_json::Value) -> K {
        let mut k: K = serde_json::from_value(v.clone()).unwrap();
        k.meta_mut().managed_fields = None;
        k
    }

    fn parsed<K: serde::de::DeserializeOwned>(v: &serde_json::Value) -> K {
        // From bytes, as the client reads them: keys are borrowed there.
        let bytes = serde_json::to_vec(v).unwrap();
        serde_json::from_slice::<Unmanaged<K>>(&bytes).unwrap().0
    }

    #[test]
    fn a_deployment_parses_as_it_would_with_its_managed_fields_dropped() {
        let v = deployment();
        let whole: Deployment = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(
            whole.metadata.managed_fields.as_ref().map(Vec::len),
            Some(2)
        );
        let d: Deployment = parsed(&v);
        assert_eq!(d.metadata.managed_fields, None);
        assert_eq!(d, dropped::<Deployment>(&v));
        // The escaped key, the annotation named like the skipped key, the
        // IntOrString both ways.
        assert_eq!(d.metadata.labels.unwrap()["a\"b"], "x");
        assert!(
            d.metadata
                .annotations
                .unwrap()
                .contains_key("managedFields")
        );
        let ru = d.spec.unwrap().strategy.unwrap().rolling_update.unwrap();
        assert_eq!(
            serde_json::to_value(ru).unwrap(),
            json!({"maxSurge": 2, "maxUnavailable": "0%"})
        );
    }

    #[test]
    fn other_kinds_and_metadata_only_objects_parse_the_same() {
        let mut v = deployment();
        let meta = v["metadata"].clone();
        v["apiVersion"] = json!("v1");
        v["kind"] = json!("Service");
        v["spec"] = json!({"type": "ClusterIP", "ports": [{"port": 80, "targetPort": "http"}],
                           "selector": {"app": "f"}});
        v["status"] = json!({"loadBalancer": {}});
        assert_eq!(parsed::<Service>(&v), dropped::<Service>(&v));
        let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": meta.clone(), "status": {"allocatable": {"cpu": "4"},
            "images": [{"names": ["a"], "sizeBytes": 1}]}});
        assert_eq!(parsed::<Node>(&node), dropped::<Node>(&node));
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta.clone(), "spec": {"containers": []},
            "status": {"phase": "Running", "podIP": "10.0.0.9"}});
        assert_eq!(parsed::<Pod>(&pod), dropped::<Pod>(&pod));
        let partial = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": meta});
        let p: PartialObjectMeta<Deployment> = parsed(&partial);
        assert_eq!(p.metadata.managed_fields, None);
        assert_eq!(p.metadata.uid.as_deref(), Some("u1"));
    }

    #[test]
    fn requests_are_those_of_the_kind_stood_for() {
        type Sets = PartialObjectMeta<k8s_openapi::api::apps::v1::ReplicaSet>;
        // A metadata-only watch stays one (the API server sends metadata).
        assert!(Unmanaged::<Sets>::metadata_api());
        assert!(!Unmanaged::<Deployment>::metadata_api());
        assert_eq!(
            Unmanaged::<Deployment>::url_path(&(), Some("ns")),
            Deployment::url_path(&(), Some("ns"))
        );
    }

    #[test]
    fn malformed_input_is_still_refused() {
        let bad = br#"{"metadata": {"name": 3}}"#;
        assert!(serde_json::from_slice::<Unmanaged<Deployment>>(bad).is_err());
        let truncated = br#"{"metadata": {"managedFields": [{"manager": "x"}"#;
        assert!(serde_json::from_slice::<Unmanaged<Deployment>>(truncated).is_err());
    }
}
