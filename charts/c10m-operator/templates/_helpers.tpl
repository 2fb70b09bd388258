{{- define "c10m-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "c10m-operator.serviceAccountName" -}}
{{- default (include "c10m-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "c10m-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "c10m-operator.labels" -}}
{{ include "c10m-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- /*
Whether to render a monitoring.coreos.com/v1 object of kind .kind: "true"
or "". .enabled is true (always: `helm template` as Argo CD and Flux run
it, with none of the cluster's APIs), false (never) or "auto" (only when
the cluster serves the kind, as `helm install`/`upgrade` see it).
*/}}
{{- define "c10m-operator.monitoringEnabled" -}}
{{- if eq (toString .enabled) "auto" -}}
{{- if .root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind) }}true{{ end -}}
{{- else if eq (toString .enabled) "true" -}}
true
{{- end -}}
{{- end -}}

{{- /*
The labels .labels (the value named .value) as YAML, for a monitoring
object's metadata beside the chart's own; refuses to override one of the
chart's labels.
*/}}
{{- define "c10m-operator.extraLabels" -}}
{{- $own := include "c10m-operator.labels" .root | fromYaml -}}
{{- range $k, $v := .labels -}}
{{- if hasKey $own $k -}}
{{- fail (printf "%s sets %s, a label the chart sets itself" $.value $k) -}}
{{- end -}}
{{- end -}}
{{- with .labels -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}

{{- /*
The Lease the replicas elect their leader on, in the release namespace: the
release's full name. A release never changes its name or namespace, so the
old and the new pods of every rolling update elect on this one Lease; that
is what keeps a rolling update to one leader. It is deliberately not a value
(leaderElection.leaseName was removed): a Lease renamed in a rolling update
lets the old pods and the new ones each elect a leader, and both reconcile.
*/}}
{{- define "c10m-operator.leaseName" -}}
{{- include "c10m-operator.fullname" . -}}
{{- end -}}

{{- /*
The ClusterRoleBinding that grants the operator its rights is named after
what the release operates on, never after the release:
  "c10m-operator-cluster-wide"           watchNamespace unset (every namespace)
  "c10m-operator-namespace-<namespace>"  watchNamespace set
Helm refuses to install or adopt an object another release owns, so a second
release operating on the same scope fails at `helm install` ("... exists and
cannot be imported into the current release: invalid ownership metadata"),
even where the check below cannot run.
*/}}
{{- define "c10m-operator.scopeBinding" -}}
{{- if .Values.watchNamespace -}}
c10m-operator-namespace-{{ .Values.watchNamespace }}
{{- else -}}
c10m-operator-cluster-wide
{{- end -}}
{{- end -}}

{{- /*
Refuses a release whose operator would reconcile fleets another operator
installation already reconciles: two leaders, each on its own Lease, acting
on one fleet. A binding of another release installed by an earlier chart
(named after its release, labelled app.kubernetes.io/name=c10m-operator)
refuses every release: its scope cannot be read from it, until that release
is upgraded to this chart. It reads the scope bindings above (one list of
ClusterRoleBindings; `lookup` reads the cluster under `helm install` and
`upgrade`, Flux's helm-controller and `--dry-run=server`, and returns nothing
under `helm template`, Argo CD and client-side dry runs). A binding is this
release's when Helm's ownership annotations name this release and namespace;
one without them was installed outside Helm (`helm template | kubectl apply`,
Argo CD) and counts as another installation.
  - cluster-wide: refused beside any other cluster-wide or namespaced one
    (their namespaces are among every namespace);
  - watching X: refused beside a cluster-wide one or another watching X.
A release switching between the two (`helm upgrade --set watchNamespace`)
meets only its own binding, and keeps one Lease through its rolling update.
*/}}
{{- define "c10m-operator.refuseASecondOperator" -}}
{{- $mine := include "c10m-operator.scopeBinding" . -}}
{{- $wide := "c10m-operator-cluster-wide" -}}
{{- $perNamespace := "c10m-operator-namespace-" -}}
{{- $release := printf "%s/%s" .Release.Namespace .Release.Name -}}
{{- range index (lookup "rbac.authorization.k8s.io/v1" "ClusterRoleBinding" "" "") "items" -}}
{{- $name := .metadata.name -}}
{{- $labels := .metadata.labels | default dict -}}
{{- $earlier := and (eq (index $labels "app.kubernetes.io/name" | default "") "c10m-operator") (ne $name $wide) (not (hasPrefix $perNamespace $name)) -}}
{{- if $earlier -}}
{{- /* A binding of a release installed by an earlier chart, named after its release: its scope cannot be read from it. */ -}}
{{- $a := index .metadata "annotations" | default dict -}}
{{- $ns := index $a "meta.helm.sh/release-namespace" | default "" -}}
{{- $rel := index $a "meta.helm.sh/release-name" | default "" -}}
{{- if ne (printf "%s/%s" $ns $rel) $release -}}
{{- fail (printf "ClusterRoleBinding %s belongs to release %s in namespace %s, installed by an earlier c10m-operator chart: its operator may reconcile the fleets this release's would, and an earlier chart's binding does not say which. Upgrade that release to this chart first (helm upgrade %s ... -n %s), or uninstall it." $name (default "(outside Helm)" $rel) (default "(none)" $ns) (default "RELEASE" $rel) (default "NAMESPACE" $ns)) -}}
{{- end -}}
{{- end -}}
{{- if or (eq $name $mine) (eq $name $wide) (and (eq $mine $wide) (hasPrefix $perNamespace $name)) -}}
{{- $a := index .metadata "annotations" | default dict -}}
{{- $ns := index $a "meta.helm.sh/release-namespace" | default "" -}}
{{- $rel := index $a "meta.helm.sh/release-name" | default "" -}}
{{- if ne (printf "%s/%s" $ns $rel) $release -}}
{{- $owner := "an installation outside Helm (it has no meta.helm.sh ownership annotations)" -}}
{{- $remedy := "remove that installation first" -}}
{{- if $rel -}}
{{- $owner = printf "release %s in namespace %s" $rel $ns -}}
{{- $remedy = printf "uninstall it first (helm uninstall %s -n %s)" $rel $ns -}}
{{- end -}}
{{- $theirs := "every namespace" -}}
{{- if ne $name $wide -}}
{{- $theirs = printf "namespace %s" (trimPrefix $perNamespace $name) -}}
{{- $remedy = printf "%s, or give this release a watchNamespace no other operator covers" $remedy -}}
{{- end -}}
{{- $ours := "every namespace" -}}
{{- with $.Values.watchNamespace -}}
{{- $ours = printf "namespace %s" . -}}
{{- end -}}
{{- fail (printf "ClusterRoleBinding %s belongs to %s, whose c10m operator reconciles fleets in %s; this release's would reconcile fleets in %s. Two operators on one fleet each elect a leader on their own Lease, and both act on it. Run one operator per namespace, or a single cluster-wide one: %s." $name $owner $theirs $ours $remedy) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
