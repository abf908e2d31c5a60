/**
 * gpuhub cull warnings inside JupyterLab.
 *
 * Polls the server extension's `gpuhub/culling` relay (on load, every 30 s while the tab is
 * visible, and when it becomes visible again; a hidden tab does not poll, so it never keeps
 * its own server looking used). While the hub has warned this server, a JupyterLab
 * notification (never auto-closing) says when the server will be stopped and offers a Snooze
 * action that POSTs to the relay and updates the notification with the hub's answer.
 *
 * When the relay stops answering (the server was stopped), the warning is replaced by what
 * happened: stopped at, why, files kept, and a link to the hub home page to start it again.
 *
 * A GPU of this server that went bad (one machine: an XID 79, a double-bit ECC error ...) is
 * told at once: while the tab is visible a long poll (`gpuhub/culling?wait=25`) waits on the
 * hub for this user's GPU failures to change, and an error notification says what happened,
 * that the files are kept and that a restart gets a healthy GPU.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

const POLL_MS = 30_000;
const GPU_WAIT_S = 25; // the hub holds a long poll at most this long (culling_api.MAX_GPU_WAIT)
const MAX_MESSAGE = 140;
const REMIND_MINUTES = 5; // a warning the user closed comes back once this close to the deadline // JupyterLab truncates longer notification messages

interface ICullWarning {
  deadline: number;
  reason: string;
  snoozes_left: number;
  snooze_seconds: number;
  warned_at: number;
}

interface IGpuFailure {
  devices: string[];
  since: number | null;
  reason: string;
  xid: number | null;
}

interface ICullingReply {
  enabled: boolean;
  server: string | null;
  now: number;
  warning: ICullWarning | null;
  gpu_failed?: IGpuFailure | null;
  gpu_wait?: number;
  error?: string;
}

interface IReply<T> {
  status: number;
  body: T;
}

function pad(n: number): string {
  return n < 10 ? `0${n}` : `${n}`;
}

/** HH:MM in the browser's time zone. */
function clock(epochSeconds: number): string {
  const d = new Date(epochSeconds * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

function minutesLeft(deadline: number, now: number): number {
  return Math.max(0, Math.ceil((deadline - now) / 60));
}

function warningMessage(w: ICullWarning, now: number, prefix = ''): string {
  const left = w.deadline - now;
  const when =
    left <= 0
      ? 'any moment now'
      : left < 120
      ? `at ${clock(w.deadline)} (in ${Math.ceil(left)} s)`
      : `at ${clock(w.deadline)} (in ${minutesLeft(w.deadline, now)} min)`;
  const head = `${prefix}This server will be stopped ${when}: `;
  const tail = '. Your files are kept.';
  let reason = (w.reason || 'idle').trim().replace(/\.+$/, '');
  const room = MAX_MESSAGE - head.length - tail.length;
  if (reason.length > room) {
    reason = reason.slice(0, Math.max(0, room - 1)) + '\u2026';
  }
  return head + reason + tail;
}

/** What a holder of a GPU that went bad is told (under JupyterLab's 140 characters). */
function gpuFailureMessage(f: IGpuFailure): string {
  const when = typeof f.since === 'number' ? ` at ${clock(f.since)}` : '';
  const head = `This server's GPU failed${when} (`;
  const tail = '). Files are kept; a restart gets a healthy GPU.';
  let reason = (f.reason || 'out of service').trim().replace(/\.+$/, '');
  const room = MAX_MESSAGE - head.length - tail.length;
  if (reason.length > room) {
    reason = reason.slice(0, Math.max(0, room - 1)) + '\u2026';
  }
  return head + reason + tail;
}

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => window.setTimeout(resolve, ms));
}

/**
 * Whether the notification's toast is on screen (JupyterLab's toasts carry the notification id;
 * if that ever changes, a warning is simply treated as closed and refreshed less often).
 */
function toastVisible(id: string): boolean {
  const el = document.getElementById(id);
  return !!el && !!el.closest('.Toastify');
}

class CullWatcher {
  constructor(private settings: ServerConnection.ISettings) {}

  start(): void {
    void this.poll();
    this._timer = window.setInterval(() => {
      if (document.visibilityState === 'visible') {
        void this.poll();
      }
    }, POLL_MS);
    document.addEventListener('visibilitychange', () => {
      if (document.visibilityState === 'visible') {
        void this.poll();
        void this.watchGpu();
      }
    });
    void this.watchGpu();
  }

  private async request<T>(
    method: 'GET' | 'POST',
    wait = 0
  ): Promise<IReply<T>> {
    let url = URLExt.join(this.settings.baseUrl, 'gpuhub', 'culling');
    if (wait > 0) {
      url += `?wait=${wait}`;
    }
    const init: RequestInit = { method, cache: 'no-store' };
    if (method === 'POST') {
      init.body = JSON.stringify({});
    }
    const resp = await ServerConnection.makeRequest(url, init, this.settings);
    let body: any = {};
    try {
      body = await resp.json();
    } catch {
      body = {};
    }
    return { status: resp.status, body: body as T };
  }

  /** Seconds since the epoch on the server's clock (the hub's deadline is on that clock). */
  private now(): number {
    return Date.now() / 1000 + this._offset;
  }

  async poll(): Promise<void> {
    if (this._busy) {
      return;
    }
    this._busy = true;
    try {
      const { status, body } = await this.request<ICullingReply>('GET');
      if (status === 200 && body && body.enabled === false) {
        // Not under a hub: nothing will ever be culled here.
        this._disabled = true;
        window.clearInterval(this._timer);
        return;
      }
      if (status !== 200 || !body) {
        if (status !== 502) {
          this.serverGone(); // our own server no longer answers: it was stopped
        }
        return; // 502: the hub briefly unreachable, keep whatever is shown
      }
      this._failures = 0;
      if (typeof body.now === 'number') {
        this._offset = body.now - Date.now() / 1000;
      }
      this.show(body.warning);
      this.showGpuFailure(body.gpu_failed || null);
    } catch (err) {
      console.debug('gpuhub: culling poll failed', err);
      this.serverGone();
    } finally {
      this._busy = false;
    }
  }

  /**
   * The long poll for GPU failures, while the tab is visible: the hub answers as soon as this
   * user's failed GPUs change (or after GPU_WAIT_S). Where the hub does not hold it (an older
   * hub, too many waiting, no health monitor on Kubernetes) it falls back to the 30 s poll's
   * pace. Failures back off; only the regular poll decides that the server is gone.
   */
  async watchGpu(): Promise<void> {
    if (this._gpuWatching) {
      return;
    }
    this._gpuWatching = true;
    try {
      while (
        !this._goneShown &&
        !this._disabled &&
        document.visibilityState === 'visible'
      ) {
        const started = Date.now();
        let held = false;
        try {
          const { status, body } = await this.request<ICullingReply>(
            'GET',
            GPU_WAIT_S
          );
          if (status === 200 && body && body.enabled === false) {
            return;
          }
          if (status === 200 && body) {
            held = typeof body.gpu_wait === 'number' && body.gpu_wait > 0;
            if (typeof body.now === 'number') {
              this._offset = body.now - Date.now() / 1000;
            }
            this.showGpuFailure(body.gpu_failed || null);
          }
        } catch (err) {
          console.debug('gpuhub: GPU health poll failed', err);
        }
        if (!held) {
          await sleep(POLL_MS);
        } else if (Date.now() - started < 1000) {
          await sleep(1000); // never more than one a second, whatever the hub says
        }
      }
    } finally {
      this._gpuWatching = false;
    }
  }

  /** The hub says this server's GPU went bad (or, null, that it no longer does). */
  private showGpuFailure(f: IGpuFailure | null): void {
    if (!f) {
      if (this._gpuKey !== null && this._gpuId) {
        // An admin uncordoned it, or a GPU reset cleared its error counters.
        if (Notification.manager.has(this._gpuId)) {
          Notification.update({
            id: this._gpuId,
            message: 'The GPU of this server is back in service.',
            type: 'info',
            autoClose: 10000,
            actions: []
          });
        }
      }
      this._gpuId = null;
      this._gpuKey = null;
      return;
    }
    const key = `${f.since}:${(f.devices || []).join(',')}`;
    if (key === this._gpuKey) {
      return; // shown already (or closed by the user: it stays closed)
    }
    this._gpuKey = key;
    if (this._gpuId && Notification.manager.has(this._gpuId)) {
      Notification.dismiss(this._gpuId);
    }
    this._gpuId = Notification.error(gpuFailureMessage(f), {
      autoClose: false,
      actions: [
        {
          label: 'Hub home',
          caption:
            'Stop this server and start it again: it gets a healthy GPU (your files are kept)',
          displayType: 'accent',
          callback: () => {
            window.location.href = this.hubHome();
          }
        }
      ]
    });
  }

  private actions(w: ICullWarning): Notification.IAction[] {
    if (!(w.snoozes_left > 0)) {
      return [];
    }
    const minutes = Math.round((w.snooze_seconds || 0) / 60);
    return [
      {
        label: 'Snooze',
        caption: `Keep this server ${minutes ? `${minutes} min ` : ''}longer (${
          w.snoozes_left
        } snooze${w.snoozes_left === 1 ? '' : 's'} left)`,
        displayType: 'accent',
        callback: (event: MouseEvent) => {
          event.preventDefault(); // keep the notification; we update it with the result
          void this.snooze();
        }
      }
    ];
  }

  private notify(
    message: string,
    type: Notification.TypeOptions,
    actions: Notification.IAction[],
    autoClose: number | false
  ): void {
    if (this._id && Notification.manager.has(this._id)) {
      Notification.update({
        id: this._id,
        message,
        type,
        autoClose,
        actions
      });
    } else {
      this._id = Notification.emit(message, type, { autoClose, actions });
    }
  }

  /** The hub home page, where the culled notice and the start button are. */
  private hubHome(): string {
    const prefix = PageConfig.getOption('hubPrefix') || '/hub/';
    const host = PageConfig.getOption('hubHost') || '';
    return host + URLExt.join(prefix, 'home');
  }

  /**
   * Our server stopped answering. Two failed polls in a row (a restart of the proxy is one)
   * replace whatever is shown — a stale "will be stopped" — by what happened.
   */
  private serverGone(): void {
    this._failures += 1;
    if (this._failures < 2 || this._goneShown) {
      return;
    }
    this._goneShown = true;
    window.clearInterval(this._timer);
    const w = this._last;
    const when = w && w.deadline <= this.now() + POLL_MS / 1000 ? ` at ${clock(Math.min(w.deadline, this.now()))}` : '';
    const why = w ? `: ${(w.reason || 'idle').trim().replace(/\.+$/, '')}` : '';
    let message = `This server was stopped${when}${why}. Your files are kept; start it again from the hub home page.`;
    if (message.length > MAX_MESSAGE) {
      message = `This server was stopped${when}. Your files are kept; start it again from the hub home page.`;
    }
    const actions: Notification.IAction[] = [
      {
        label: 'Hub home',
        caption: 'Why it stopped, and start it again',
        displayType: 'accent',
        callback: () => {
          window.location.href = this.hubHome();
        }
      }
    ];
    if (this._id && Notification.manager.has(this._id)) {
      Notification.dismiss(this._id);
    }
    if (this._gpuId && Notification.manager.has(this._gpuId)) {
      Notification.dismiss(this._gpuId); // the stop notice says what to do now
    }
    this._gpuId = null;
    this._id = Notification.info(message, { autoClose: false, actions });
    this._key = null;
  }

  private show(w: ICullWarning | null, prefix = ''): void {
    this._last = w;
    if (!w) {
      if (this._id && this._key !== null) {
        this.notify(
          'This server is no longer scheduled to be stopped.',
          'info',
          [],
          5000
        );
      }
      this._id = null;
      this._key = null;
      return;
    }
    const key = `${w.warned_at}:${w.deadline}`;
    const message = warningMessage(w, this.now(), prefix);
    if (key !== this._key) {
      // A new warning (or a new deadline): show it even if an older one was dismissed.
      this._key = key;
      this._reminded = minutesLeft(w.deadline, this.now()) <= REMIND_MINUTES;
      if (this._id && Notification.manager.has(this._id)) {
        Notification.dismiss(this._id);
      }
      const actions = this.actions(w);
      this._shown = `${message}|${actions.length}`;
      this._id = Notification.warning(message, { autoClose: false, actions });
      return;
    }
    const actions = this.actions(w);
    const shown = `${message}|${actions.length}`;
    const exists = !!this._id && Notification.manager.has(this._id);
    if (exists && toastVisible(this._id!)) {
      // Same warning, on screen: refresh the countdown (and the Snooze button) when it changed.
      if (shown !== this._shown) {
        this._shown = shown;
        Notification.update({
          id: this._id!,
          message,
          type: 'warning',
          autoClose: false,
          actions
        });
      }
    } else if (
      !this._reminded &&
      minutesLeft(w.deadline, this.now()) <= REMIND_MINUTES
    ) {
      // The user closed the warning: show it once more shortly before the deadline.
      // (Updating a notification whose toast was closed pops the toast up again; so
      // otherwise a closed warning is left alone.)
      this._reminded = true;
      this._shown = shown;
      if (exists) {
        Notification.update({
          id: this._id!,
          message,
          type: 'warning',
          autoClose: false,
          actions
        });
      } else {
        this._id = Notification.warning(message, { autoClose: false, actions });
      }
    }
  }

  async snooze(): Promise<void> {
    let status = 0;
    let body: any = {};
    try {
      ({ status, body } = await this.request<any>('POST'));
    } catch (err) {
      body = { message: String(err) };
    }
    if (status === 200) {
      let reply: IReply<ICullingReply> | null = null;
      try {
        reply = await this.request<ICullingReply>('GET');
      } catch {
        reply = null;
      }
      const deadline = typeof body.deadline === 'number' ? body.deadline : null;
      const w = reply && reply.status === 200 ? reply.body.warning : null;
      if (w) {
        // Still warned, with the new deadline: say so on the same notification.
        this._key = `${w.warned_at}:${w.deadline}`;
        this._reminded = minutesLeft(w.deadline, this.now()) <= REMIND_MINUTES;
        this.notify(
          warningMessage(w, this.now(), 'Snoozed. '),
          'warning',
          this.actions(w),
          false
        );
      } else {
        const until = deadline
          ? ` It will not be stopped before ${clock(deadline)}.`
          : '';
        this.notify(`Snoozed: this server keeps running.${until}`, 'success', [], 10000);
        this._id = null;
        this._key = null;
      }
      return;
    }
    const reason = (body && body.message) || `snooze failed (${status || 'network error'})`;
    if (status === 409) {
      this.notify(reason.slice(0, MAX_MESSAGE), 'error', [], false);
    } else {
      this.notify(
        `Snooze failed: ${reason}`.slice(0, MAX_MESSAGE),
        'error',
        [],
        false
      );
      this._key = null; // the next poll shows the warning (and its Snooze) again
    }
  }

  private _busy = false;
  private _disabled = false;
  private _gpuId: string | null = null;
  private _gpuKey: string | null = null;
  private _gpuWatching = false;
  private _failures = 0;
  private _goneShown = false;
  private _last: ICullWarning | null = null;
  private _id: string | null = null;
  private _key: string | null = null;
  private _offset = 0;
  private _reminded = false;
  private _shown = '';
  private _timer = 0;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpuhub-notebook:cull-warning',
  description:
    'Shows the hub cull warning for this server, with a Snooze action, and a failed GPU.',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    const watcher = new CullWatcher(app.serviceManager.serverSettings);
    void app.restored.then(() => watcher.start());
  }
};

export default plugin;
