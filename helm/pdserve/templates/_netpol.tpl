{{/* NetworkPolicy building blocks (templates/networkpolicy.yaml). */}}

{{/* Peers from an allowedPeers value (namespaces, cidrs, peers); "" when all are empty. */}}
{{- define "pdserve.allowedPeers" -}}
{{- range .namespaces }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ . }}
{{- end }}
{{- range .cidrs }}
- ipBlock:
    cidr: {{ . }}
{{- end }}
{{- with .peers }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The `from` of the metrics ports: the allowed peers, or this namespace's pods. */}}
{{- define "pdserve.metricsFrom" -}}
{{- $peers := include "pdserve.allowedPeers" .Values.networkPolicy.metrics -}}
{{- if $peers -}}
{{ $peers }}
{{- else -}}
- podSelector: {}
{{- end -}}
{{- end -}}

{{/* Ingress rules every pdserve pod has: metrics (restricted) and health (open). */}}
{{- define "pdserve.commonIngress" -}}
- ports:
    - port: {{ .ports.metrics }}
      protocol: TCP
  from:
    {{- include "pdserve.metricsFrom" .root | nindent 4 }}
# Plaintext grpc.health.v1 only (status, nothing else): the kubelet's probes.
- ports:
    - port: {{ .ports.health }}
      protocol: TCP
{{- end -}}

{{/* Redis's port: the in-chart one's, or the one in externalRedis.url (default 6379). */}}
{{- define "pdserve.redisPort" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.port -}}
{{- else -}}
{{- $hostport := regexReplaceAll "^rediss?://([^/]*).*$" .Values.externalRedis.url "${1}" -}}
{{- regexFind ":[0-9]+$" $hostport | trimPrefix ":" | default "6379" -}}
{{- end -}}
{{- end -}}

{{/* Egress every pdserve pod needs: DNS and Redis, then the extra rules. */}}
{{- define "pdserve.commonEgress" -}}
{{- $eg := .Values.networkPolicy.egress -}}
- to:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: {{ $eg.dns.namespace }}
      podSelector:
        matchLabels:
          {{- toYaml $eg.dns.podLabels | nindent 10 }}
  ports:
    - port: {{ $eg.dns.port }}
      protocol: UDP
    - port: {{ $eg.dns.port }}
      protocol: TCP
- ports:
    - port: {{ include "pdserve.redisPort" . | int }}
      protocol: TCP
  {{- if .Values.redis.enabled }}
  to:
    {{- include "pdserve.peer" (dict "root" . "component" "redis") | nindent 4 }}
  {{- else if $eg.externalRedisCIDRs }}
  to:
    {{- range $eg.externalRedisCIDRs }}
    - ipBlock:
        cidr: {{ . }}
    {{- end }}
  {{- end }}
{{- with $eg.extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* policyTypes of a pdserve pod's policy. */}}
{{- define "pdserve.policyTypes" -}}
{{- if .Values.networkPolicy.egress.enabled -}}
["Ingress", "Egress"]
{{- else -}}
["Ingress"]
{{- end -}}
{{- end -}}
