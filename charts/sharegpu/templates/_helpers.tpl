{{- define "sharegpu.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sharegpu.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* selector labels of one component: include "sharegpu.selector" (list . "extender") */}}
{{- define "sharegpu.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ $.Chart.Name }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "sharegpu.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* HAMi's published image, by digest when one is given */}}
{{- define "sharegpu.hamiImage" -}}
{{- $img := .Values.agent.hami.image -}}
{{- if $img.digest -}}
{{ $img.repository }}@{{ $img.digest }}
{{- else -}}
{{ $img.repository }}:{{ $img.tag }}
{{- end -}}
{{- end -}}

{{- define "sharegpu.schedulerImage" -}}
{{- $tag := .Values.scheduler.image.tag -}}
{{- if not $tag -}}
{{- $tag = printf "v%s.%s.0" .Capabilities.KubeVersion.Major (trimSuffix "+" .Capabilities.KubeVersion.Minor) -}}
{{- end -}}
{{ .Values.scheduler.image.repository }}:{{ $tag }}
{{- end -}}

{{- define "sharegpu.extenderService" -}}
{{ include "sharegpu.fullname" . }}-extender
{{- end -}}

{{/* the DNS name the extender's certificate carries and its clients check */}}
{{- define "sharegpu.extenderServerName" -}}
{{ include "sharegpu.extenderService" . }}.{{ .Release.Namespace }}.svc
{{- end -}}

{{- define "sharegpu.extenderURL" -}}
{{ ternary "https" "http" .Values.extender.tls.enabled }}://{{ include "sharegpu.extenderServerName" . }}:{{ .Values.extender.port }}
{{- end -}}

{{/* the name of the extender's verb port (Service, container, NetworkPolicy) */}}
{{- define "sharegpu.extenderPortName" -}}
{{ ternary "https" "http" .Values.extender.tls.enabled }}
{{- end -}}

{{- define "sharegpu.extenderTLSSecret" -}}
{{ .Values.extender.tls.existingSecret | default (printf "%s-tls" (include "sharegpu.extenderService" .)) }}
{{- end -}}

{{/* kube-scheduler's client certificate for the extender's verbs (kubernetes.io/tls) */}}
{{- define "sharegpu.extenderClientSecret" -}}
{{ .Values.extender.tls.existingClientSecret | default (printf "%s-client-tls" (include "sharegpu.extenderService" .)) }}
{{- end -}}

{{/*
The extender's CA, certificate and key and kube-scheduler's client certificate and key (base64
PEM) as JSON {"ca", "crt", "key", "clientCrt", "clientKey"}: kept from the chart's Secrets in the
cluster (lookup; empty under helm template) or made here: a CA, a certificate for the Service's
DNS names (server and client auth: a follower presents it to the leader) and a client
certificate, both signed by the CA, which the extender requires of every caller. Made once per
render (kept in .Values._extenderTLS), so the Secrets, the checksums and the scheduler's caData
agree. {} with existingSecret.
*/}}
{{- define "sharegpu.extenderTLS" -}}
{{- if .Values.extender.tls.existingSecret -}}
{}
{{- else -}}
{{- if not (hasKey .Values "_extenderTLS") -}}
{{- $name := include "sharegpu.extenderService" . -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "sharegpu.extenderTLSSecret" .) -}}
{{- $oldClient := lookup "v1" "Secret" .Release.Namespace (include "sharegpu.extenderClientSecret" .) -}}
{{- $out := dict -}}
{{- if and $old $old.data (index $old.data "ca.crt") $oldClient $oldClient.data (index $oldClient.data "tls.crt") -}}
{{- $out = dict "ca" (index $old.data "ca.crt") "crt" (index $old.data "tls.crt") "key" (index $old.data "tls.key") "clientCrt" (index $oldClient.data "tls.crt") "clientKey" (index $oldClient.data "tls.key") -}}
{{- else -}}
{{- /* new, or from a release without a client certificate: all made afresh (the CA's key is
kept nowhere), and both Deployments roll on the new checksums */ -}}
{{- $svc := include "sharegpu.extenderServerName" . -}}
{{- $ca := genCA (printf "%s-ca" $name) 3650 -}}
{{- $cert := genSignedCert $svc nil (list $svc (printf "%s.cluster.local" $svc) (printf "%s.%s" $name .Release.Namespace) $name) 3650 $ca -}}
{{- $client := genSignedCert (printf "%s-scheduler" (include "sharegpu.fullname" .)) nil nil 3650 $ca -}}
{{- $out = dict "ca" ($ca.Cert | b64enc) "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "clientCrt" ($client.Cert | b64enc) "clientKey" ($client.Key | b64enc) -}}
{{- end -}}
{{- $_ := set .Values "_extenderTLS" $out -}}
{{- end -}}
{{- toJson (index .Values "_extenderTLS") -}}
{{- end -}}
{{- end -}}

{{/* where the chart's kube-scheduler finds the extender's CA when it is not in caData */}}
{{- define "sharegpu.extenderCADir" -}}
/etc/sharegpu-extender-ca
{{- end -}}

{{/* where kube-scheduler finds its client certificate for the extender (tls.crt, tls.key) */}}
{{- define "sharegpu.extenderClientDir" -}}
/etc/sharegpu-extender-client
{{- end -}}

{{/* the extenders[] entry of a KubeSchedulerConfiguration */}}
{{- define "sharegpu.extenderConfig" -}}
- urlPrefix: {{ include "sharegpu.extenderURL" . }}
  filterVerb: filter
  prioritizeVerb: prioritize
  bindVerb: bind
  weight: {{ .Values.scheduler.extenderWeight }}
  {{- if .Values.extender.tls.enabled }}
  # TLS verified with the extender's CA under the Service's name (also when urlPrefix names an
  # IP address); the client certificate is what the extender requires of every caller
  enableHTTPS: true
  tlsConfig:
    serverName: {{ include "sharegpu.extenderServerName" . }}
    certFile: {{ include "sharegpu.extenderClientDir" . }}/tls.crt
    keyFile: {{ include "sharegpu.extenderClientDir" . }}/tls.key
    {{- if .Values.extender.tls.existingSecret }}
    caFile: {{ include "sharegpu.extenderCADir" . }}/ca.crt
    {{- else }}
    caData: {{ (include "sharegpu.extenderTLS" . | fromJson).ca }}
    {{- end }}
  {{- else }}
  enableHTTPS: false
  {{- end }}
  nodeCacheCapable: true
  ignorable: {{ .Values.scheduler.ignorable }}
  httpTimeout: {{ .Values.scheduler.httpTimeout }}
  {{- if ne .Values.scheduler.mode "profile" }}
  # the cluster's own scheduler: only GPU pods are sent to the extender
  managedResources:
    - name: aliyun.com/gpu-mem
      ignoredByScheduler: false
    - name: aliyun.com/gpu-core.percentage
      ignoredByScheduler: false
    - name: aliyun.com/gpu
      ignoredByScheduler: false
    - name: nvidia.com/gpu
      ignoredByScheduler: false
  {{- end }}
  {{- /* profile mode: no managedResources, so every pod of the profile is sent (a ResourcePolicy
  governs pods without GPUs too); those are answered at once and bound by the extender */}}
{{- end -}}

{{- define "sharegpu.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}
