/**
 * gpuhub notices inside JupyterLab: cull warnings with Snooze, a failed GPU, and why the
 * server stopped.
 *
 * One long poll (`gpuhub/culling?wait=25`, relayed by the server extension to the hub) is held
 * while the tab is visible: the hub answers as soon as anything this user is told changes (a
 * warning, a snooze, a failed GPU, a stop), else after 25 s; a hidden tab asks nothing, so it
 * never keeps its own server looking used. While the hub has warned this server, a JupyterLab
 * notification (never auto-closing) says when the server will be stopped, counting down on the
 * browser's clock, with a Snooze action.
 *
 * A person on the page is told to the hub, not inferred from traffic (an open tab polls the
 * server every few seconds, touched or not): the first click, key or scroll on the page after a
 * GPU-idle warning appeared (not on the warning itself, whose Snooze says what it does) is
 * posted once (`gpuhub/culling/seen`, no body: the relay names this server, the hub stamps its
 * own time), and at the deadline the hub spends one snooze for it instead of stopping the server.
 *
 * Any stop (the culler, a reclaim, the user's or an admin's from the hub) is told by the hub
 * before the server goes: the notice says when and why, that the files are kept, and offers
 * the hub home page. JupyterLab's own "Server unavailable or unreachable… Restart?" dialog is
 * replaced (this plugin provides `IConnectionLost`): when the server stops answering and no
 * reason came, the notice says so in the same place.
 */
import {
  IConnectionLost,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { addRunAsJob, RUN_AS_JOB } from './runAsJob';

const POLL_MS = 30_000;
const GPU_WAIT_S = 25; // the hub holds a long poll at most this long (culling_api.MAX_GPU_WAIT)
const MAX_MESSAGE = 140; // JupyterLab truncates longer notification messages
const REMIND_MINUTES = 5; // a warning the user closed comes back once this close to the deadline
const HUB_DOWN_RETRY_MS = 5_000; // the relay could not reach the hub (502): ask again after this
const SEEN_RETRY_MS = 5_000; // a report of a person that did not arrive: tried again on input after this
const PERSON_EVENTS = ['pointerdown', 'keydown', 'wheel']; // what a person does, never what a page does

interface ICullWarning {
  deadline: number;
  reason: string;
  snoozes_left: number;
  snooze_seconds: number;
  warned_at: number;
  rule?: string | null;
}

interface IGpuFailure {
  devices: string[];
  since: number | null;
  reason: string;
  xid: number | null;
}

interface IStopped {
  at: number;
  reason: string;
  rule: string | null; // 'stop': from the hub (the user or an admin); else the culler's rule, 'reclaim'
}

interface ICullingReply {
  enabled: boolean;
  server: string | null;
  now: number;
  warning: ICullWarning | null;
  gpu_failed?: IGpuFailure | null;
  stopped?: IStopped | null;
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

const STOPPED_TAIL = '. Your files are kept; start it again from the hub home page.';
const SHORT_TAIL = '. Your files are kept.'; // where the reason needs the room (the button says the rest)

/** Why this server stopped (under JupyterLab's 140 characters). */
function stoppedMessage(at: number | null, reason: string | null, rule: string | null): string {
  const when = at !== null ? ` at ${clock(at)}` : '';
  if (rule === 'stop') {
    return `This server was stopped${when} from the hub${STOPPED_TAIL}`;
  }
  if (!reason) {
    return `This server was stopped${when}${STOPPED_TAIL}`;
  }
  const head = `This server was stopped${when}: `;
  let why = reason.trim().replace(/\.+$/, '');
  const tail =
    head.length + why.length + STOPPED_TAIL.length <= MAX_MESSAGE ? STOPPED_TAIL : SHORT_TAIL;
  const room = MAX_MESSAGE - head.length - tail.length;
  if (why.length > room) {
    why = why.slice(0, Math.max(0, room - 1)) + '\u2026';
  }
  return head + why + tail;
}

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => window.setTimeout(resolve, ms));
}

/**
 * Hide these notifications' toasts for good, whatever reaches them later: a style rule on
 * their elements (a toast's element id is its notification's id, as ``toastVisible`` reads).
 * ``visibility``, not ``display``: a dismissed toast leaves the page at the end of its exit
 * animation, which does not run (nor end) on an element that is not displayed.
 */
function hideToasts(ids: (string | null)[]): void {
  const live = ids.filter((id): id is string => !!id);
  if (live.length === 0) {
    return;
  }
  const style = document.createElement('style');
  style.textContent =
    live.map(id => `.Toastify__toast[id="${CSS.escape(id)}"]`).join(',\n') +
    ' { visibility: hidden !important; }';
  document.head.appendChild(style);
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
    document.addEventListener('visibilitychange', () => {
      if (document.visibilityState === 'visible') {
        void this.watch();
        this.tick();
      }
    });
    for (const type of PERSON_EVENTS) {
      window.addEventListener(type, event => this.personInput(event), {
        capture: true,
        passive: true
      });
    }
    void this.watch();
  }

  /**
   * A click, key or scroll on the page: the first after a GPU-idle warning appeared is reported
   * (once per warning; a fresh warning after a snooze asks for a fresh sign). Input on the
   * warning itself does not count (its Snooze button snoozes; closing it is not using the page).
   */
  private personInput(event: Event): void {
    const w = this._last;
    if (!event.isTrusted || this._goneShown || !w || w.rule !== 'gpu-idle') {
      return;
    }
    const target = event.target as Element | null;
    if (target && typeof target.closest === 'function' && target.closest('.Toastify')) {
      return;
    }
    const key = `${w.warned_at}`;
    if (key === this._seenFor || Date.now() < this._seenRetryAt) {
      return;
    }
    this._seenFor = key;
    void this.reportSeen(key);
  }

  private async reportSeen(key: string): Promise<void> {
    const url = URLExt.join(this.settings.baseUrl, 'gpuhub', 'culling', 'seen');
    let ok = false;
    try {
      const resp = await ServerConnection.makeRequest(
        url,
        { method: 'POST', cache: 'no-store' },
        this.settings
      );
      ok = resp.status === 200;
    } catch (err) {
      console.debug('gpuhub: could not report a person on the page', err);
    }
    if (!ok && this._seenFor === key) {
      this._seenFor = null; // the next input (after a pause) tries again
      this._seenRetryAt = Date.now() + SEEN_RETRY_MS;
    }
  }

  /** Whether this tab already says that (and why) the server stopped. */
  get stopShown(): boolean {
    return this._goneShown;
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

  /**
   * What the hub says of this server, applied: the warning, a failed GPU, a stop. Returns
   * 'gone' when our own server no longer answers (a network error, or the hub's 424 for a
   * server that is not running), 'hub' when the relay could not reach the hub (502), and
   * 'held' / 'quick' when the hub held the long poll / answered at once.
   */
  private async ask(wait: number): Promise<'held' | 'quick' | 'hub' | 'gone' | 'off'> {
    let reply: IReply<ICullingReply>;
    try {
      reply = await this.request<ICullingReply>('GET', wait);
    } catch (err) {
      console.debug('gpuhub: culling poll failed', err);
      return 'gone';
    }
    if (this._goneShown) {
      // Another question (JupyterLab's lost connection, a second poll) already brought the stop:
      // an answer that left the hub before it must not bring the warning back under the notice.
      return 'held';
    }
    const { status, body } = reply;
    if (status === 200 && body && body.enabled === false) {
      this._disabled = true; // not under a hub: nothing will ever be culled here
      return 'off';
    }
    if (status === 502) {
      return 'hub';
    }
    if (status !== 200 || !body) {
      return 'gone';
    }
    if (typeof body.now === 'number') {
      this._offset = body.now - Date.now() / 1000;
    }
    if (body.stopped) {
      this.showStopped(body.stopped);
      return 'held';
    }
    this.show(body.warning);
    this.showGpuFailure(body.gpu_failed || null);
    return typeof body.gpu_wait === 'number' && body.gpu_wait > 0
      ? 'held'
      : 'quick';
  }

  /**
   * The long poll, while the tab is visible and the server runs. Where the hub does not hold
   * it (too many waiting) it asks at the 30 s pace, and never more than once a second.
   */
  async watch(): Promise<void> {
    if (this._watching) {
      return;
    }
    this._watching = true;
    try {
      while (
        !this._goneShown &&
        !this._disabled &&
        document.visibilityState === 'visible'
      ) {
        const started = Date.now();
        const outcome = await this.ask(GPU_WAIT_S);
        if (outcome === 'gone') {
          await this.lost();
        } else if (outcome === 'hub') {
          await sleep(HUB_DOWN_RETRY_MS); // keep whatever is shown
        } else if (outcome === 'quick') {
          await sleep(POLL_MS);
        } else if (Date.now() - started < 1000) {
          await sleep(1000);
        }
      }
    } finally {
      this._watching = false;
    }
  }

  /**
   * Our server stopped answering and the hub gave no reason first (a hidden tab, a server
   * that ended by itself, a network cut). One more question tells a blip from a stop; then
   * the notice says what is known: the warning's reason if its deadline has passed.
   */
  async lost(): Promise<void> {
    if (this._goneShown || this._checking) {
      return;
    }
    this._checking = true;
    try {
      const outcome = await this.ask(0);
      if (outcome !== 'gone' || this._goneShown) {
        return;
      }
      const w = this._last;
      if (w && w.deadline <= this.now() + 5) {
        this.showStopped({
          at: Math.min(w.deadline, this.now()),
          reason: w.reason || 'idle',
          rule: w.rule || null
        });
      } else {
        this.showStopped(null);
      }
    } finally {
      this._checking = false;
    }
  }

  /** JupyterLab lost its server: gpuhub's notice instead of the stock "Restart?" dialog. */
  connectionLost(): void {
    if (!this._goneShown) {
      void this.lost();
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

  /** The server stopped (``stopped``: the hub's words; null: it stopped answering). */
  private showStopped(stopped: IStopped | null): void {
    if (this._goneShown) {
      return;
    }
    this._goneShown = true;
    this.stopTicker();
    const message = stopped
      ? stoppedMessage(stopped.at, stopped.reason, stopped.rule)
      : `This server is no longer running (stopped from the hub, or it ended)${STOPPED_TAIL}`;
    // The warning (and the GPU notice: the stop notice says what to do now) leaves the screen
    // now, by a style rule, before the notice is drawn; the dismissal that removes it follows.
    // A dismissal alone did not hold: a countdown update sent a moment before (the tick at the
    // deadline, when the cull also comes) reaches the toast two timer hops later (react-toastify
    // 9.1.1's update, then its event bus, each a setTimeout 0), and Chrome clamps each hop to
    // 4 ms inside the countdown's chain of timers, while a dismissal sent from the poll's answer
    // is not clamped. It overtook the update twice (fresh-clone runs on 2026-12-05 and 06), even
    // one task later; the update then found the leaving toast (kept until its exit animation
    // ends) and put it back, outside JupyterLab's manager, for good ("will be stopped any moment
    // now" under the notice). Hidden by the rule, a warning brought back stays off the screen.
    const stale = [this._id, this._gpuId];
    hideToasts(stale);
    this._gpuId = null;
    this._id = null;
    this._key = null;
    window.setTimeout(() => {
      for (const id of stale) {
        if (id && Notification.manager.has(id)) {
          Notification.dismiss(id);
        }
      }
      this.stopNotice(message);
    }, 0);
  }

  /**
   * The stop notice: a banner of this page's own, not a JupyterLab toast. JupyterLab loads its
   * toasts' code from the server the first time one is shown, and the server is going away: a
   * tab that had shown no toast yet could show none (seen: the chunk's request answered 424).
   */
  private stopNotice(message: string): void {
    const box = document.createElement('div');
    box.className = 'gpuhub-stop-notice';
    box.setAttribute('role', 'alert');
    box.style.cssText =
      'position:fixed;top:8px;left:50%;transform:translateX(-50%);z-index:100000;max-width:640px;' +
      'padding:10px 14px;border-radius:4px;border:1px solid var(--jp-brand-color1,#1976d2);' +
      'background:var(--jp-layout-color1,#fff);color:var(--jp-ui-font-color1,#000);' +
      'box-shadow:0 2px 8px rgba(0,0,0,.3);font:var(--jp-ui-font-size1,13px) var(--jp-ui-font-family,sans-serif);' +
      'display:flex;gap:12px;align-items:center';
    const text = document.createElement('span');
    text.textContent = message;
    const button = document.createElement('button');
    button.type = 'button';
    button.className = 'jp-Button jp-mod-styled jp-mod-accept';
    button.textContent = 'Hub home';
    button.title = 'Start it again from the hub home page (why it stopped is there too)';
    button.addEventListener('click', () => {
      window.location.href = this.hubHome();
    });
    box.append(text, button);
    document.body.appendChild(box);
  }

  /** The countdown, on the browser's clock: every second in the last two minutes. */
  private tick(): void {
    const w = this._last;
    if (!w || this._goneShown || !this._id) {
      return;
    }
    if (document.visibilityState === 'visible') {
      this.show(w, this._prefix);
    }
    const left = w.deadline - this.now();
    const next = left > 130 ? 30_000 : 1000;
    this.stopTicker();
    this._ticker = window.setTimeout(() => this.tick(), next);
  }

  private stopTicker(): void {
    if (this._ticker) {
      window.clearTimeout(this._ticker);
      this._ticker = 0;
    }
  }

  private show(w: ICullWarning | null, prefix = ''): void {
    if (this._goneShown) {
      return; // the stop notice says what happened: no warning (nor countdown) after it
    }
    const ticking = this._last !== null && this._ticker !== 0;
    this._last = w;
    if (w && !ticking) {
      this._ticker = window.setTimeout(() => this.tick(), 1000);
    }
    if (!w) {
      this.stopTicker();
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
    if (key === this._key && !prefix) {
      prefix = this._prefix; // "Snoozed. " stays until the warning changes
    }
    const message = warningMessage(w, this.now(), prefix);
    if (key !== this._key) {
      // A new warning (or a new deadline): show it even if an older one was dismissed.
      this._key = key;
      this._prefix = prefix;
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
        this._prefix = 'Snoozed. ';
        this._last = w;
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

  private _checking = false;
  private _seenFor: string | null = null; // the warning (warned_at) a person was reported for
  private _seenRetryAt = 0;
  private _disabled = false;
  private _gpuId: string | null = null;
  private _gpuKey: string | null = null;
  private _watching = false;
  private _goneShown = false;
  private _last: ICullWarning | null = null;
  private _id: string | null = null;
  private _key: string | null = null;
  private _offset = 0;
  private _reminded = false;
  private _prefix = '';
  private _shown = '';
  private _ticker = 0;
}

/**
 * Starts the watcher, and answers JupyterLab's "connection lost" (it replaces the hub
 * extension's "Server unavailable or unreachable… Restart?" dialog, whose Restart cannot help
 * a server gpuhub stopped; the package's page config disables that plugin too): silent when
 * the stop notice already says why, otherwise the watcher finds out and says so.
 */
const plugin: JupyterFrontEndPlugin<IConnectionLost> = {
  id: 'gpuhub-notebook:cull-warning',
  description:
    'Shows the hub cull warning for this server, with a Snooze action, a failed GPU, and why the server stopped.',
  autoStart: true,
  provides: IConnectionLost,
  activate: (app: JupyterFrontEnd): IConnectionLost => {
    const watcher = new CullWatcher(app.serviceManager.serverSettings);
    void app.restored.then(() => watcher.start());
    return async () => {
      watcher.connectionLost();
    };
  }
};

/**
 * "Run as job" on the open notebook (File and Run menus, the notebook's context menu and toolbar
 * from `schema/run-as-job.json`, and the command palette): see `runAsJob.ts`.
 */
const runAsJob: JupyterFrontEndPlugin<void> = {
  id: 'gpuhub-notebook:run-as-job',
  description: 'Run the open notebook as a job in the team\'s GPU queue, optionally stopping this server.',
  autoStart: true,
  optional: [ICommandPalette],
  activate: (app: JupyterFrontEnd, palette: ICommandPalette | null): void => {
    addRunAsJob(app);
    if (palette) {
      palette.addItem({ command: RUN_AS_JOB, category: 'Notebook Operations' });
    }
  }
};

export default [plugin, runAsJob];
