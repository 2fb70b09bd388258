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
