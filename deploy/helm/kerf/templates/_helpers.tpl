{{/* The image of every kerf container: a digest wins over the tag; the tag defaults to appVersion. */}}
{{- define "kerf.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* Labels of every object. */}}
{{- define "kerf.labels" -}}
app.kubernetes.io/part-of: kerf
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Selector labels of one component; give it (dict "component" NAME). */}}
{{- define "kerf.selectorLabels" -}}
app.kubernetes.io/name: kerf
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The username of a ServiceAccount of the release; give it (dict "root" $ "name" NAME). */}}
{{- define "kerf.serviceAccountUser" -}}
system:serviceaccount:{{ .root.Release.Namespace }}:{{ .name }}
{{- end }}

{{/* Whether the controller keeps the webhooks' caBundle itself. */}}
{{- define "kerf.selfSignedWebhook" -}}
{{- if eq .Values.webhook.tls.mode "self-signed" }}true{{ end -}}
{{- end }}

{{/* The Secret holding the webhook's certificate when the controller does not make it. */}}
{{- define "kerf.webhookSecret" -}}
{{- if eq .Values.webhook.tls.mode "secret" -}}
{{ required "webhook.tls.secretName is required with webhook.tls.mode secret" .Values.webhook.tls.secretName }}
{{- else -}}
kerf-webhook-tls
{{- end -}}
{{- end }}

{{/* clientConfig of a kerf webhook (and caBundle where the chart knows it); give it (dict "root" $ "path" PATH). */}}
{{- define "kerf.webhookClientConfig" -}}
service:
  name: kerf-webhook
  namespace: {{ .root.Release.Namespace }}
  path: {{ .path }}
  port: 443
{{- if eq .root.Values.webhook.tls.mode "secret" }}
caBundle: {{ required "webhook.tls.caBundle is required with webhook.tls.mode secret" .root.Values.webhook.tls.caBundle }}
{{- end }}
{{- end }}

{{/* Annotations of the webhook configurations: cert-manager's CA injector fills caBundle. */}}
{{- define "kerf.webhookAnnotations" -}}
{{- if eq .Values.webhook.tls.mode "cert-manager" }}
annotations:
  cert-manager.io/inject-ca-from: {{ .Release.Namespace }}/kerf-webhook
{{- end }}
{{- end }}

{{/* The default GpuClasses as the controller reads them: a YAML stream of GpuClasses. */}}
{{- define "kerf.defaultGpuClasses" -}}
{{- $classes := list }}
{{- range .Values.defaultGpuClasses.classes }}
{{- $spec := deepCopy (.spec | default dict) }}
{{- if not $.Values.features.extendedResources }}
{{- $_ := unset $spec "extendedResourceName" }}
{{- end }}
{{- $classes = append $classes (dict "name" .name "spec" $spec) }}
{{- end }}
{{- if .Values.features.schedulerSlices }}
{{- $classes = append $classes (dict "name" "scheduler-slice.gpu.kerf.dev" "spec" (dict "allocator" "Scheduler" "slicing" (dict "memoryGranularity" "1Gi" "defaultCompute" 10) "sharing" (dict "strategy" "MPS"))) }}
{{- end }}
{{- range $i, $class := $classes }}
{{- if $i }}
---
{{- end }}
apiVersion: gpu.kerf.dev/v1alpha1
kind: GpuClass
metadata:
  name: {{ $class.name }}
spec:
  {{- toYaml $class.spec | nindent 2 }}
{{- end }}
{{- end }}
