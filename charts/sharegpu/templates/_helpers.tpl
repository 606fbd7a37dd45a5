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

{{- define "sharegpu.extenderURL" -}}
http://{{ include "sharegpu.extenderService" . }}.{{ .Release.Namespace }}.svc:{{ .Values.extender.port }}
{{- end -}}

{{/* the extenders[] entry of a KubeSchedulerConfiguration */}}
{{- define "sharegpu.extenderConfig" -}}
- urlPrefix: {{ include "sharegpu.extenderURL" . }}
  filterVerb: filter
  prioritizeVerb: prioritize
  bindVerb: bind
  weight: {{ .Values.scheduler.extenderWeight }}
  enableHTTPS: false
  nodeCacheCapable: true
  ignorable: {{ .Values.scheduler.ignorable }}
  httpTimeout: {{ .Values.scheduler.httpTimeout }}
  managedResources:
    - name: aliyun.com/gpu-mem
      ignoredByScheduler: false
    - name: aliyun.com/gpu-core.percentage
      ignoredByScheduler: false
    - name: aliyun.com/gpu
      ignoredByScheduler: false
    - name: nvidia.com/gpu
      ignoredByScheduler: false
{{- end -}}

{{- define "sharegpu.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}
